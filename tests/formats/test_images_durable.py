"""Images are encoded by the workers and written by a writer thread, each flushed to
disk (fsync) as it is written; the files copied beside them are flushed when the writer
closes. An output folder removed during the run fails the run rather than come back
without the images written before, and a failure on the writer's thread is one line that
leaves nothing."""

import json
import os
import pickle
import threading

import numpy as np
import pytest
from PIL import Image

from tests.builders import assert_one_line_error, disk_full_after, siblings
from tldp_cli.errors import InputError, OutputError
from tldp_cli.formats import images, images_writer
from tldp_cli.run.pipeline import PerturbOptions, perturb


def photo_folder(path, count=6, size=40):
    rng = np.random.default_rng(3)
    (path / "cats").mkdir(parents=True)
    for i in range(count):
        pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(path / "cats" / f"{i}.png")
    (path / "README.txt").write_text("six cats\n")
    (path / "metadata.jsonl").write_text("".join(json.dumps({"file_name": f"cats/{i}.png"}) + "\n"
                                                 for i in range(count)))
    return path


def test_every_output_file_is_flushed_to_disk(tmp_path, monkeypatch):
    src = photo_folder(tmp_path / "in")
    flushed = set()
    real_fsync = os.fsync

    def fsync(fd):
        flushed.add(os.readlink(f"/proc/self/fd/{fd}").rsplit("/", 1)[-1] + f":{os.fstat(fd).st_ino}")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    out = tmp_path / "out"
    perturb(PerturbOptions(input=src, eps=1.0, out=out, seed=5, allow_weak_seed=True, workers=2,
                           copy_other=True))
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) == 8  # six images, the README and the index
    assert {f"{p.name}:{p.stat().st_ino}" for p in files} <= flushed


def test_output_removed_during_the_run_fails(tmp_path, monkeypatch):
    """The work folder renamed away after the second image (a cleanup script, say): the
    images after it used to make the folder again and be committed without the first two."""
    src = photo_folder(tmp_path / "in")
    real_write = images_writer.ImageFolderWriter.write
    calls = []

    def write_then_remove(self, job, start, block):
        real_write(self, job, start, block)
        calls.append(job.name)
        if len(calls) == 2:
            if getattr(self, "_disk", None):
                self._disk.close()  # the first two images are on disk
            os.rename(self.root, tmp_path / "gone")

    monkeypatch.setattr(images_writer.ImageFolderWriter, "write", write_then_remove)
    with pytest.raises(OutputError, match="removed while tldp wrote the output"):
        perturb(PerturbOptions(input=src, eps=1.0, out=tmp_path / "out", seed=5,
                               allow_weak_seed=True, workers=1))
    assert siblings(tmp_path) == {"gone", "in"}


def test_a_write_failure_in_the_writer_thread_is_one_line_and_leaves_nothing(cli, tmp_path,
                                                                             monkeypatch):
    src = photo_folder(tmp_path / "in", count=12, size=64)
    disk_full_after(monkeypatch, 5)
    result = cli("perturb", src, "--eps", "1", "--out", tmp_path / "out", "--workers", "2")
    assert_one_line_error(result, 1, "No space left on device", "out")
    assert siblings(tmp_path) == {"in"}


def test_a_writer_sent_to_dask_workers_writes_there_itself(tmp_path):
    """Pickled for a Dask worker, the writer has no writer thread: it writes and flushes
    each image itself."""
    src = photo_folder(tmp_path / "in", count=1)
    reader = images.open_reader(src, images.FormatOptions())
    writer = images.create_writer(reader, tmp_path / "out", np.dtype(np.int16), images.FormatOptions())
    remote = pickle.loads(pickle.dumps(writer.block_writer())).__self__
    assert remote._disk is None and remote.digests() == {}
    [job] = reader.arrays()
    remote.write(job, 0, np.zeros((1, 40, 40, 3), np.int16))
    assert (tmp_path / "out" / "cats" / "0.png").stat().st_size > 0
    writer.close()
    reader.close()


def test_a_writer_that_fails_to_start_leaves_no_thread(tmp_path, monkeypatch):
    """A file beside the images that cannot be read stops the writer while it copies the
    other files: its writer thread must not have been left running."""
    src = photo_folder(tmp_path / "in")

    def unreadable(self, source, rel):
        raise InputError(f"{source}: cannot read (Permission denied)")

    monkeypatch.setattr(images_writer.ImageFolderWriter, "_copy", unreadable)
    with pytest.raises(InputError, match="README.txt"):
        perturb(PerturbOptions(input=src, eps=1.0, out=tmp_path / "out", seed=5,
                               allow_weak_seed=True, copy_other=True))
    assert not [t for t in threading.enumerate() if t.name.startswith("tldp write")]
    assert siblings(tmp_path) == {"in"}


def test_an_image_removed_during_the_run_fails_it(tmp_path, monkeypatch):
    """One image deleted from the work folder after it was written (the folder itself
    stays): the run used to end with exit 0, the manifest listing one image fewer."""
    src = photo_folder(tmp_path / "in")
    real_finish = images_writer.ImageFolderWriter.finish

    def remove_one_then_finish(self):
        self._disk.close()  # every image is on disk
        (self.root / "cats" / "2.png").unlink()
        real_finish(self)

    monkeypatch.setattr(images_writer.ImageFolderWriter, "finish", remove_one_then_finish)
    with pytest.raises(OutputError, match=r"out/cats/2\.png: removed while tldp wrote the output"):
        perturb(PerturbOptions(input=src, eps=1.0, out=tmp_path / "out", seed=5,
                               allow_weak_seed=True, workers=2))
    assert siblings(tmp_path) == {"in"}


def test_a_folder_tldp_may_not_list_stops_the_run(cli, tmp_path, monkeypatch):
    """os.walk skips a folder it cannot list without a word: its images were left out of
    an output that ended with exit 0."""
    src = photo_folder(tmp_path / "in")
    (src / "dogs").mkdir()
    real_scandir = os.scandir

    def scandir(path="."):
        if os.fspath(path) == str(src / "dogs"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    result = cli("perturb", src, "--eps", "1", "--out", tmp_path / "out")
    assert_one_line_error(result, 1, f"cannot list {src / 'dogs'} (Permission denied)")
    assert siblings(tmp_path) == {"in"}


@pytest.mark.parametrize("budget, depth", [(64 << 20, 8), (10_000, 2), (100, 1)])
def test_the_writer_queue_holds_a_bounded_number_of_bytes(tmp_path, monkeypatch, budget, depth):
    """Encoded images wait for the writer thread: at most QUEUED_BYTES of them (40x40 RGB
    images of 4800 bytes here), and always room for one, so memory stays flat for large
    images."""
    monkeypatch.setattr(images_writer, "QUEUED_BYTES", budget)
    src = photo_folder(tmp_path / "in", count=1)
    reader = images.open_reader(src, images.FormatOptions())
    writer = images.create_writer(reader, tmp_path / "out", np.dtype(np.int16), images.FormatOptions())
    assert writer._disk._queue.maxsize == depth
    writer.close()
    reader.close()
