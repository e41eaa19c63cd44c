"""Calibration's refusals say what serves the user's aim."""

import pytest

from tests.builders import assert_one_line_error
from tldp_cli.errors import OutOfReach
from tldp_cli.privacy import mechanisms


def test_a_per_record_eps_tldp_cannot_meet_points_to_privunit_not_the_element_budget():
    """The refusal of --budget record --eps 5 on a digit advised "--budget element", which
    keeps the 5 but makes it each element's (780.9 per record at --eps 1), and did not name
    privunit, the mechanism docs/choosing-eps.md gives for a per-record eps of a few units."""
    with pytest.raises(OutOfReach) as refused:
        mechanisms.calibrate(mechanism="tldp", noise="discrete-laplace", budget="record", epsilon=5,
                             range_width=256, elements=784)
    text = str(refused.value)
    assert "certifies at least 7.646 per record" in text
    assert "--mechanism privunit" in text and "docs/choosing-eps.md" in text
    assert "--budget element" not in text


def test_perturb_says_it_in_one_line(cli, tmp_path, digits):
    import numpy as np

    src = tmp_path / "d.npy"
    np.save(src, digits[:10])
    result = cli("perturb", src, "--eps", "5", "--budget", "record")
    assert_one_line_error(result, 2, "--mechanism privunit", "docs/choosing-eps.md")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.npy"]
