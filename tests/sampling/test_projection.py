"""The default basis of volumes (sampling/projection.py, VolumeDctBasis): which records are
volumes, the 3-D DCT against a dense one, its order, its orthonormal rows, and a volume
released end to end through perturb (a NIfTI file made by nibabel, read back with it). The
2-D and 1-D bases are tested in test_privunit.py."""

import itertools
import json

import nibabel as nib
import numpy as np
import pytest
import scipy.fft

from tldp_cli.privacy import mechanisms, privunit
from tldp_cli.sampling import engine, projection


def dense_3d(shape, index):
    """The basis as an explicit k x I matrix: row j the outer product of DCT-II rows i, j, l
    of the three axes, on its channel (an independent construction, one row at a time)."""
    channels, d, h, w, last = projection.volume_layout(shape)
    rows = []
    for c, i, j, l in zip(*index):
        cube = np.einsum("a,b,c->abc", projection.dct_matrix(d, i + 1)[i], projection.dct_matrix(h, j + 1)[j],
                         projection.dct_matrix(w, l + 1)[l])
        row = np.zeros((channels, d, h, w))
        row[c] = cube
        rows.append((np.moveaxis(row, 0, 3) if last else row).ravel())
    return np.array(rows)


@pytest.mark.parametrize("shape, volume", [
    ((200, 32, 32), True), ((5, 6, 7), True), ((33, 41, 25), True), ((2, 5, 7, 9), True), ((3, 4, 5, 6, 7), True),
    ((128, 96, 2), True), ((28, 28, 3), False), ((28, 28, 1), False), ((32, 32, 4), False), ((3, 28, 28), False),
    ((1, 28, 28), False), ((4, 5, 6), False), ((28, 28), False), ((784,), False), ((), False)])
def test_which_records_are_volumes(shape, volume):
    """A public rule of the shape: three axes, neither (H, W, C) nor (C, H, W) with C in 1, 3,
    4; or four axes or more. privacy/privunit.spatial_axes states the same axes."""
    assert projection.is_volume(shape) == volume
    if volume:
        assert privunit.spatial_axes(shape) == shape[-3:]
        assert isinstance(projection.dct_basis(shape, 4), projection.VolumeDctBasis)
        assert "3-D DCT-II over the last three axes" in projection.describe_layout(shape)
    elif shape:
        assert len(privunit.spatial_axes(shape)) <= 2
        assert isinstance(projection.dct_basis(shape, 1), projection.DctBasis)


def test_the_volume_basis_is_a_dense_3d_dct_computed_separably():
    shape, k = (5, 6, 7), 40
    basis = projection.dct_basis(shape, k)
    dense = dense_3d(shape, basis.index)
    x = np.random.default_rng(1).random((4, *shape))
    assert np.allclose(basis.project(x), x.reshape(4, -1) @ dense.T, rtol=0, atol=1e-12)
    z = np.random.default_rng(2).standard_normal((3, k))
    assert np.allclose(basis.synthesize(z), (z @ dense).reshape(3, *shape), rtol=0, atol=1e-12)
    _, i, j, l = basis.index
    full = scipy.fft.dctn(x, axes=(1, 2, 3), norm="ortho")
    assert np.allclose(basis.project(x), full[:, i, j, l], rtol=0, atol=1e-12)


def test_the_volume_basis_rows_are_orthonormal():
    for shape, k in (((5, 6, 7), 40), ((200, 32, 32), 128), ((2, 9, 4, 5), 30), ((3, 4, 5), 60)):
        basis = projection.dct_basis(shape, k)
        eye = np.eye(k)
        rows = basis.synthesize(eye).reshape(k, -1)  # row j of B: synthesize of basis vector e_j
        assert np.abs(rows @ rows.T - eye).max() < 1e-12
        assert np.abs(basis.project(basis.synthesize(eye)) - eye).max() < 1e-12


def test_the_order_is_the_normalised_frequency_then_the_documented_ties():
    """(i/D)^2 + (j/H)^2 + (l/W)^2, then the lower i + j + l, then i, then j, against a sort of
    every frequency of the volume (the basis only enumerates the candidates that can be first)."""
    for shape, k in (((200, 32, 32), 128), ((8, 8, 8), 100), ((5, 6, 9), 270), ((30, 3, 50), 64), ((6, 6, 6), 7)):
        d, h, w = shape
        every = sorted(itertools.product(range(d), range(h), range(w)),
                       key=lambda f: (f[0] ** 2 * (h * w) ** 2 + f[1] ** 2 * (d * w) ** 2 + f[2] ** 2 * (d * h) ** 2,
                                      sum(f), f[0], f[1]))
        _, i, j, l = projection.dct_basis(shape, k).index
        assert list(zip(i.tolist(), j.tolist(), l.tolist())) == every[:k]
    # equal axes: (0, 0, 1), (0, 1, 0) and (1, 0, 0) tie on the key and on the sum; the lower i puts
    # (1, 0, 0) last, the lower j puts (0, 0, 1) first
    _, i, j, l = projection.dct_basis((9, 9, 9), 4).index
    assert list(zip(i.tolist(), j.tolist(), l.tolist())) == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0)]


def test_a_stack_of_colour_images_is_a_volume_with_its_channels_last():
    """Regression: a multi-page RGB TIFF, one record of (pages, H, W, 3), was read as `pages`
    channels of (H, W, 3) volumes: the 3-D DCT ran across the colour axis and the pages got
    no shared frequencies. A (D, H, W, 3 or 4) record is now a volume over its first three
    axes, per colour channel, written back in its own layout; auto writes it from mid-range,
    as a colour image. A (D, H, W, C) record with C other than 3, 4, and any other shape,
    keeps its basis."""
    shape, k = (4, 5, 6, 3), 40
    assert privunit.spatial_axes(shape) == (4, 5, 6) and privunit.is_colour_image(shape)
    assert privunit.reference_choice("auto", shape) == "mid"
    basis = projection.dct_basis(shape, k)
    assert isinstance(basis, projection.VolumeDctBasis) and basis.channels == 3
    assert "channels last" in projection.describe_layout(shape)
    dense = dense_3d(shape, basis.index)
    x = np.random.default_rng(4).random((2, *shape))
    assert np.allclose(basis.project(x), x.reshape(2, -1) @ dense.T, rtol=0, atol=1e-12)
    channel, i, j, l = basis.index
    full = scipy.fft.dctn(x, axes=(1, 2, 3), norm="ortho")
    assert np.allclose(basis.project(x), full[:, i, j, l, channel], rtol=0, atol=1e-12)
    z = np.random.default_rng(5).standard_normal((3, k))
    assert np.allclose(basis.synthesize(z), (z @ dense).reshape(3, *shape), rtol=0, atol=1e-12)
    for other in ((4, 5, 6, 7), (3, 5, 6, 2), (1, 5, 6, 3), (3, 4, 5, 6, 3)):
        assert privunit.spatial_axes(other) == other[-3:] and not privunit.is_colour_image(other), other


def test_channels_of_a_volume_each_get_the_same_frequencies():
    basis = projection.dct_basis((2, 5, 6, 7), 9)
    channel, i, j, l = basis.index
    assert channel.tolist() == [0, 1, 0, 1, 0, 1, 0, 1, 0]
    assert (i[0::2][:4].tolist(), j[0::2][:4].tolist(), l[0::2][:4].tolist()) == \
        (i[1::2].tolist(), j[1::2].tolist(), l[1::2].tolist())
    x = np.random.default_rng(3).random((2, 2, 5, 6, 7))
    full = scipy.fft.dctn(x, axes=(2, 3, 4), norm="ortho")
    assert np.allclose(basis.project(x), full[:, channel, i, j, l], rtol=0, atol=1e-12)


def test_the_frequencies_are_those_of_the_3d_dct_in_cycles_per_record():
    basis = projection.dct_basis((200, 32, 32), 128)
    _, i, j, l = basis.index
    assert np.array_equal(basis.frequencies(), np.sqrt(i * i + j * j + l * l) / 2.0)
    assert basis.frequencies()[0] == 0 and basis.frequencies().max() > 1


def test_a_200_slice_volume_is_no_longer_released_slice_by_slice():
    """Regression (docs/choosing-eps.md, "Volumes"): the default basis of a (200, 32, 32)
    record at the default k = 128 was a 2-D DCT per slice, one coefficient (the slice's mean)
    for the first 128 slices and nothing for the other 72. Now the basis follows the volume:
    a smooth volume comes back from its 128 coefficients, every slice of it."""
    calib = mechanisms.calibrate_privunit(epsilon=8, record_shape=(200, 32, 32), value_range=(0, 1))
    basis = engine.privunit_basis(calib)
    c_d, c_h, c_w = (projection.dct_matrix(n, 8) for n in (200, 32, 32))
    # a smooth volume: two low 3-D frequencies, (1, 1, 0) and (5, 0, 1), that vary along every axis
    x = (np.einsum("a,b,c->abc", c_d[1], c_h[1], c_w[0]) + np.einsum("a,b,c->abc", c_d[5], c_h[0], c_w[1]))[None]
    back = basis.synthesize(basis.project(x))[0]
    assert np.abs(back - x[0]).max() < 1e-12
    slices = back.reshape(200, -1)
    assert (slices.max(axis=1) - slices.min(axis=1) > 1e-4).all()  # no slice flat, none empty
    # the release too: every slice of the written volume varies
    from tldp_cli import perturb_array

    out = perturb_array(np.random.default_rng(4).random((2, 200, 32, 32)), eps=8, value_range=(0, 1),
                        mechanism="privunit", seed=7, allow_weak_seed=True, dtype="float64").array
    spread = out.reshape(2, 200, -1).max(axis=2) - out.reshape(2, 200, -1).min(axis=2)
    assert (spread > 0).all()


def test_pre_emphasis_and_write_back_weights_apply_to_volumes():
    """Measured on three real scans (docs/choosing-eps.md): the image rules' weights, on the
    3-D frequencies."""
    low = mechanisms.calibrate_privunit(epsilon=2, record_shape=(33, 41, 25), value_range=(0, 1))
    assert low.privunit.emphasis_exponent == privunit.EMPHASIS_EXPONENT
    assert low.privunit.prior_exponent == privunit.SPECTRAL_PRIOR_EXPONENT
    basis = engine.privunit_basis(low)
    assert np.allclose(engine.emphasis_weights(low, basis), (1 + basis.frequencies()) ** privunit.EMPHASIS_EXPONENT)
    assert engine.write_back_weights(low, basis) is not None


def test_a_nifti_volume_is_released_on_the_3d_basis_end_to_end(cli, tmp_path):
    """A NIfTI file written by nibabel, one record of 160 x 24 x 20 voxels (more slices than
    k = 128: before, 32 of them were written flat at the reference), released with privunit
    and read back with nibabel: the input's shape and affine, every slice varying, and a
    manifest that names the 3-D basis."""
    d, h, w = np.meshgrid(np.arange(160), np.arange(24), np.arange(20), indexing="ij")
    brain = 1000 * np.exp(-((d - 80) ** 2 / 3000 + (h - 12) ** 2 / 60 + (w - 10) ** 2 / 40))
    affine = np.diag([2.0, 2.0, 2.5, 1.0])
    src = tmp_path / "scan.nii.gz"
    nib.Nifti1Image(brain.astype(np.int16), affine).to_filename(src)
    out = tmp_path / "scan.tldp.nii.gz"
    result = cli("perturb", src, "--mechanism", "privunit", "--eps", "8", "--range", "0:1024", "--out", out,
                 "--seed", "3", "--allow-weak-seed")
    assert result.exit_code == 0, result.stderr
    img = nib.load(out)
    assert img.shape == (160, 24, 20) and np.array_equal(img.affine, nib.load(src).affine)
    values = np.asarray(img.dataobj, dtype=np.float64)
    assert np.isfinite(values).all() and values.min() >= 0 and values.max() <= 1024
    spread = values.reshape(160, -1).max(axis=1) - values.reshape(160, -1).min(axis=1)
    assert (spread > 0).all()
    m = json.loads((tmp_path / "scan.tldp.nii.gz.manifest.json").read_text())
    basis = m["privunit"]["basis"]
    assert basis["kind"] == "dct" and basis["k"] == 128
    assert basis["layout"] == "3-D DCT-II over the last three axes (a volume), 160 x 24 x 20"
    assert basis["description"].startswith("the 128 lowest frequencies of the 3-D DCT-II")
    assert m["privunit"]["pre_emphasis"]["weights"] == "spectral"
    assert 0 < m["accounting"]["per_record"]["epsilon"] <= 8 and m["accounting"]["per_record"]["delta"] == 0


def test_seeded_volumes_are_bit_identical_across_workers_and_blocking(tmp_path):
    """An HDF5 file of 40 volumes (made by h5py, read back with it): the same bytes with one
    worker and whole blocks as with three workers and blocks of three records."""
    import h5py

    from tldp_cli.run.pipeline import PerturbOptions, perturb
    from tests.builders import SEED

    data = np.random.default_rng(6).integers(0, 256, (40, 6, 10, 12), dtype=np.uint8)
    src = tmp_path / "volumes.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("scans", data=data, chunks=(5, 6, 10, 12), compression="gzip")
    results = []
    for workers, block in ((1, 1 << 21), (3, 3 * 720)):
        out = tmp_path / f"out{workers}.h5"
        perturb(PerturbOptions(input=src, eps=4.0, mechanism="privunit", out=out, seed=SEED,
                               workers=workers, block_elements=block))
        with h5py.File(out, "r") as f:
            results.append(f["scans"][...])
        manifest = json.loads((tmp_path / f"out{workers}.h5.manifest.json").read_text())
        assert manifest["privunit"]["basis"]["layout"].startswith("3-D DCT-II over the last three axes")
    np.testing.assert_array_equal(results[0], results[1])
    assert results[0].shape == data.shape and not np.array_equal(results[0], data)
