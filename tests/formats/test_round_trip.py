"""The round-trip contract (tests/builders.py RoundTrip) on every registered format.

The tests are parametrised over the registry (formats.names()), each format with the
cases that live beside its other tests; a registered format without a case fails here,
and so does a case of a format the registry does not know.
"""

import pytest

from tldp_cli import formats
from tests.formats.test_dataset_folder import DatasetDictRoundTrip, DatasetFolderRoundTrip
from tests.formats.test_hdf5 import Hdf5RoundTrip
from tests.formats.test_images import ImagesRoundTrip
from tests.formats.test_nifti import NiftiRoundTrip
from tests.formats.test_sharded_models import ShardedRoundTrip
from tests.formats.test_npy_roundtrip import NpyRoundTrip
from tests.formats.test_parquet import ArrowRoundTrip, ParquetRoundTrip
from tests.formats.test_webdataset import WebDatasetRoundTrip
from tests.formats.test_zarr import ZarrV2RoundTrip, ZarrV3RoundTrip
from tests.run.test_model_params import CompressedNpzRoundTrip, NpzRoundTrip, SafetensorsRoundTrip

CASES = (NpyRoundTrip, Hdf5RoundTrip, ZarrV3RoundTrip, ZarrV2RoundTrip, NpzRoundTrip, CompressedNpzRoundTrip,
         SafetensorsRoundTrip, ShardedRoundTrip, NiftiRoundTrip, ParquetRoundTrip, ArrowRoundTrip,
         DatasetFolderRoundTrip, DatasetDictRoundTrip, WebDatasetRoundTrip, ImagesRoundTrip)


def _registered_cases():
    for name in formats.names():
        cases = [case for case in CASES if case.format == name]
        for case in cases or [None]:
            yield pytest.param((name, case), id=f"{name}-{case.__name__ if case else 'no case'}")


@pytest.fixture(params=list(_registered_cases()))
def case(request):
    name, case = request.param
    if case is None:
        pytest.fail(f"the registered format {name} has no round-trip case: add a RoundTrip subclass "
                    "beside its tests and list it in CASES")
    return case()


def test_every_case_is_of_a_registered_format():
    assert {case.format for case in CASES} <= set(formats.names())


def test_round_trip(case, cli, tmp_path):
    case.check_round_trip(cli, tmp_path)


def test_same_seed_same_output(case, cli, tmp_path):
    case.check_same_seed_same_output(cli, tmp_path)


def test_workers_give_identical_output(case, cli, tmp_path):
    case.check_workers_give_identical_output(cli, tmp_path)


def test_refuses_to_overwrite(case, cli, tmp_path):
    case.check_refuses_to_overwrite(cli, tmp_path)
