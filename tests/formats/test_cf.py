"""The CF helpers shared by the netCDF (hdf5) and Zarr formats, on their own."""

import dataclasses

import numpy as np

from tldp_cli.formats import cf


def test_values_on_a_marker_move_one_step_toward_the_range():
    block = np.array([-1.0, -1.0, 5.0, 0.5, 2.0], np.float32)
    missing = np.array([False, True, False, False, False])
    moved = cf.move_off_markers(block, missing, [np.float32(-1.0), np.float32(5.0)], (0.0, 1.0, 0.25))
    assert moved == 2
    np.testing.assert_array_equal(block, np.array([-0.75, -1.0, 4.75, 0.5, 2.0], np.float32))


def test_a_step_below_the_spacing_moves_one_ulp_and_nan_markers_match_nothing():
    block = np.array([1e9, 3.0], np.float32)
    assert cf.move_off_markers(block, None, [np.float32(1e9), np.float32(np.nan)], (0.0, 1.0, 2.0**-11)) == 1
    assert block[0] == np.nextafter(np.float32(1e9), np.float32(0)) and block[1] == 3.0


def test_integers_move_by_one_and_never_wrap_past_the_dtype():
    block = np.array([-128, -1, -2], np.int8)
    moved = cf.move_off_markers(block, None, [np.int8(-128), np.int8(-1), np.int8(0)], (0.0, 256.0, 1))
    assert moved == 2
    # -1 moves up onto the marker 0 and on to 1; -128 up to -127
    np.testing.assert_array_equal(block, np.array([-127, 1, -2], np.int8))


def test_without_a_grid_floats_move_one_ulp():
    block = np.array([-1.0], np.float64)
    assert cf.move_off_markers(block, None, [-1.0], (0.0, 1.0, None)) == 1
    assert block[0] == np.nextafter(-1.0, 0.0)


def test_markers_the_output_dtype_cannot_hold_saturate_never_wrap():
    """A cast back to the marker's own dtype took the wrapped value for the marker itself
    (2**32 - 1 as int16 is -1, which casts back to 2**32 - 1)."""
    int16, float32 = np.dtype(np.int16), np.dtype(np.float32)
    assert cf.output_marker(np.uint32(2**32 - 1), int16) == -32768
    assert cf.output_marker(np.uint64(2**64 - 1), int16) == -32768
    assert cf.output_marker(np.int64(-2**63), int16) == -32768
    assert cf.output_marker(np.int32(-2147483647), int16) == -32768
    assert cf.output_marker(-9999.0, int16) == -9999 and cf.output_marker(np.uint8(255), int16) == 255
    assert np.isnan(cf.output_marker(1e300, float32)) and np.isnan(cf.output_marker(0.1, float32))
    assert cf.output_marker(np.float64(0.5), float32) == 0.5 and np.isnan(cf.output_marker(np.nan, float32))


def test_unnamed_leaves_out_the_variables_gone_and_their_measures():
    gone = {"lat", "cell_area"}.__contains__
    assert cf.unnamed("time lat lon", gone) == "time lon"
    assert cf.unnamed("area: cell_area volume: cell_volume", gone) == "volume: cell_volume"
    assert cf.unnamed("area: cell_area", gone) == ""  # names nothing written: left out
    assert cf.unnamed("time  lon", gone) is None  # names none of them: written as it is
    assert cf.unnamed(None, gone) is None


def test_a_formula_missing_a_term_is_left_out_whole():
    gone = {"ps"}.__contains__
    assert cf.unnamed_attribute("formula_terms", "sigma: lev ps: ps ptop: ptop", gone) == ""
    assert cf.unnamed_attribute("formula_terms", "sigma: lev ptop: ptop", gone) is None
    assert cf.unnamed_attribute("ancillary_variables", "ps temp_qc", gone) == "temp_qc"


def test_record_coordinates_follow_the_record_dimension():
    """A trajectory's track and identifier, and a station's elevation, run along the record
    dimension, as does the record dimension's own coordinate (time(time) when the records run
    along time) with its bounds; another dimension's coordinate, its bounds and a grid off the
    record dimension do not."""
    dims = {"/trajectory": ("/trajectory",), "/obs": ("/obs",), "/time": ("/time",),
            "/lat": ("/trajectory", "/obs"), "/lat_bnds": ("/trajectory", "/obs", "/nv"),
            "/temp": ("/trajectory", "/obs"), "/time_bnds": ("/time", "/nv"), "/x_edge": ("/obs",),
            "/elev": ("/trajectory",)}
    attrs = {("/temp", "coordinates"): "lat x_edge elev time", ("/lat", "bounds"): "lat_bnds",
             ("/time", "bounds"): "time_bnds", ("/trajectory", "cf_role"): "trajectory_id"}
    found = cf.record_coordinates(list(dims), lambda path, key: attrs.get((path, key)), dims.__getitem__,
                                  {"/trajectory"})
    assert found == {"/lat", "/lat_bnds", "/elev", "/trajectory"}
    assert cf.record_coordinates(list(dims), lambda path, key: attrs.get((path, key)), dims.__getitem__,
                                 {"/time"}) == {"/time", "/time_bnds"}  # a time per record
    assert cf.record_coordinates(list(dims), lambda path, key: attrs.get((path, key)), dims.__getitem__,
                                 {"/obs"}) == {"/obs", "/lat", "/lat_bnds", "/x_edge"}  # not /time, /time_bnds


def test_missing_positions_hold_the_public_fill_never_a_value_of_the_data():
    """Until told, a read returns the markers as stored; told a fill, every missing position
    holds it, whatever the other records hold (it was the block's first present value)."""
    encoding = cf.Encoding((np.float32(-1.0), np.float32(np.nan)), False, None, None, np.dtype(np.float32),
                           ("_FillValue", "NaN"))
    raw = np.array([[0.75, -1.0], [np.nan, 0.25]], np.float32)
    np.testing.assert_array_equal(cf.decoded_records(raw.copy(), encoding), raw)
    filled = cf.decoded_records(raw.copy(), dataclasses.replace(encoding, fill=0.5))
    assert filled.dtype == np.float32
    np.testing.assert_array_equal(filled, np.array([[0.75, 0.5], [0.5, 0.25]], np.float32))
    other = raw.copy()
    other[0, 0] = 0.125  # another record's value: the fill does not follow it
    np.testing.assert_array_equal(cf.decoded_records(other, dataclasses.replace(encoding, fill=0.5))[1],
                                  filled[1])


def test_a_fill_the_values_dtype_cannot_hold_reads_the_block_as_float64():
    """privunit's reference 127.5 (--reference mid on 0:256) in an int16 block with a _FillValue:
    the block comes back in float64, so that a missing position adds exactly nothing."""
    encoding = cf.Encoding((np.int16(-999),), False, None, None, np.dtype(np.int16), ("_FillValue",), fill=127.5)
    block = cf.decoded_records(np.array([[3, -999, 200]], np.int16), encoding)
    assert block.dtype == np.float64
    np.testing.assert_array_equal(block, [[3.0, 127.5, 200.0]])
    whole = cf.decoded_records(np.array([[3, 4]], np.int16), encoding)  # nothing missing: as stored
    assert whole.dtype == np.int16
    taken = encoding.as_data((("_FillValue", -999.0),))  # markers taken as data keep the fill
    assert taken.fill == 127.5 and taken.markers == ()
