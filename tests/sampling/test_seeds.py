"""Seeds are secret keys: at least 128 bits unless --allow-weak-seed, from exactly one of
--seed, --seed-file and $TLDP_SEED, and never written, printed or derived into a file."""

import json
import os
import re
import secrets
import subprocess
import sys

import numpy as np
import pytest

from tests.builders import SEED, siblings
from tldp_cli.errors import UsageError
from tldp_cli.run.pipeline import PerturbOptions, perturb
from tldp_cli.sampling.rng import PATTERN_BITS, Streams, check_seed, new_seed, pattern_bits

# --mechanism baseline keeps no raw value: these tests are about the seed alone.
PERTURB = ("--eps", "1", "--range", "0:1", "--mechanism", "baseline")


@pytest.fixture
def src(tmp_path):
    path = tmp_path / "x.npy"
    np.save(path, np.random.default_rng(0).uniform(0, 1, (40, 16)).astype(np.float32))
    return path


def seed_file(path, text, mode=0o600):
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


def assert_one_line_usage_error(result, *fragments):
    assert result.exit_code == 2, (result.exit_code, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tldp: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def assert_nowhere(seed, *texts):
    for text in texts:
        data = text if isinstance(text, bytes) else text.encode()
        assert seed.encode() not in data and seed.upper().encode() not in data
        if len(seed) % 2 == 0:
            assert bytes.fromhex(seed) not in data


@pytest.mark.parametrize("weak", ["42", "0", "abcdef0123", "3f9c2a7d51e04b8a96d2c07e1fa85b4"])  # last: 31 digits
@pytest.mark.parametrize("source", ["--seed", "--seed-file", "TLDP_SEED"])
def test_weak_seeds_are_refused_in_one_line(cli, src, tmp_path, monkeypatch, weak, source):
    if source == "--seed":
        given = ("--seed", weak)
    elif source == "--seed-file":
        given = ("--seed-file", seed_file(tmp_path / "weak.seed", weak))
    else:
        monkeypatch.setenv("TLDP_SEED", weak)
        given = ()
    before = siblings(tmp_path)
    result = cli("perturb", src, *PERTURB, *given)
    assert_one_line_usage_error(result, "128 bits", "tldp seed", "--allow-weak-seed")
    assert f"holds only {4 * len(weak)} bits" in result.stderr
    assert weak not in result.stderr.replace(f"only {4 * len(weak)} bits", "")
    assert siblings(tmp_path) == before


# 32 hex digits or more, each obvious to a guesser: constant, few distinct digits, a
# repeated block, counting digits, bytes or words, a small number padded with zeros.
GUESSABLE = ["0" * 32, "F" * 32, "ab" * 16, "abba" * 8, "deadbeef" * 4, "deadbeefcafebabe" * 2,
             "0123456789abcdef" * 2, "fedcba9876543210" * 2, "0123456789abcdeffedcba9876543210",
             "000102030405060708090a0b0c0d0e0f", "00000001000200030004000500060007",
             "02468ace" * 4, "0" * 30 + "42", "20240101" + "0" * 24, "1234567890" * 4,
             "00000000000000000000000000000000" * 2]


@pytest.mark.parametrize("guessable", GUESSABLE)
def test_guessable_seeds_are_refused_in_one_line(cli, src, tmp_path, guessable):
    before = siblings(tmp_path)
    result = cli("perturb", src, *PERTURB, "--seed", guessable, "--out", tmp_path / "o.npy")
    assert_one_line_usage_error(result, "obvious pattern", "tldp seed", "--allow-weak-seed")
    assert guessable not in result.stderr and guessable.lower() not in result.stderr
    assert siblings(tmp_path) == before


def test_a_guessable_seed_recovers_the_data_which_is_why_it_is_refused(cli, tmp_path):
    """The attack: whoever guesses the seed perturbs zeros with it and subtracts."""
    data = np.random.default_rng(1).integers(0, 256, (20, 16), dtype=np.uint8)
    zeros = np.zeros_like(data)
    np.save(tmp_path / "x.npy", data)
    np.save(tmp_path / "zeros.npy", zeros)
    args = ("--eps", "1", "--mechanism", "baseline", "--seed", "0" * 32)
    assert cli("perturb", tmp_path / "x.npy", *args).exit_code == 2
    for name in ("x", "zeros"):
        result = cli("perturb", tmp_path / f"{name}.npy", *args, "--allow-weak-seed", "--json")
        assert result.exit_code == 0, result.stderr
        assert json.loads(result.stdout)["weak_seed"] is True
    released = np.load(tmp_path / "x.tldp.npy").astype(np.int64)
    noise = np.load(tmp_path / "zeros.tldp.npy").astype(np.int64)
    assert np.array_equal(released - noise, data)


def test_guessable_seeds_are_refused_by_the_library():
    for guessable in GUESSABLE:
        assert pattern_bits(guessable) < PATTERN_BITS, guessable
        with pytest.raises(UsageError, match="obvious pattern"):
            Streams("secure", guessable)
        assert Streams("secure", guessable, allow_weak_seed=True).weak_seed is True
    # An integer is read as its decimal digits and its hex digits: 2^127, 2^128 - 1 and
    # 10^40 hold 128 bits or more by length, and none of it by choice.
    for number in (2**127, 2**128 - 1, 10**40, 2**200 + 12345):
        with pytest.raises(UsageError, match="obvious pattern"):
            check_seed(number)
        assert check_seed(number, allow_weak_seed=True) is True


def test_fresh_seeds_always_pass(cli):
    """`tldp seed` output is never refused: a uniformly random 128-bit seed has a pattern
    description under PATTERN_BITS bits with probability at most 2^-40 (rng.py)."""
    described = [pattern_bits(new_seed()) for _ in range(10_000)]
    assert min(described) > PATTERN_BITS + 16, min(described)  # far from the line, not just over it
    for _ in range(20):
        seed = cli("seed").stdout.strip()
        assert len(seed) == 32 and check_seed(seed) is False
    for _ in range(200):
        assert check_seed(secrets.token_hex(32)) is False and check_seed(secrets.randbits(128) | 1 << 127) is False


def test_random_integer_seeds_pass_whatever_their_leading_zeros():
    """secrets.randbits(128) is under 128 bits long half the time; integer seeds need
    rng.MIN_INT_SEED_BITS (96): a random 128-bit integer is shorter with probability 2^-32."""
    assert check_seed(2**127 - 1 - 2**64 - 12345678901234567) is False  # 127 bits, random-looking
    assert check_seed(0x9F3C_2A7D_51E0_4B8A_96D2_C07E) is False  # 96 bits
    with pytest.raises(UsageError, match="holds only 95 bits"):
        check_seed(0x4F3C_2A7D_51E0_4B8A_96D2_C07E)
    with pytest.raises(UsageError, match="holds only 124 bits"):
        check_seed("9f3c2a7d51e04b8a96d2c07e1fa85b4")  # a string still needs 32 hex digits
    for _ in range(200):
        assert check_seed(secrets.randbits(128) >> 8) is False


@pytest.mark.parametrize("bad", ["0x3f9c2a7d51e04b8a96d2c07e1fa85b43", "-42", "my secret passphrase", ""])
def test_a_seed_that_is_not_hex_digits_is_refused(cli, src, bad):
    result = cli("perturb", src, *PERTURB, "--seed", bad, "--allow-weak-seed")
    assert_one_line_usage_error(result, "hex digits", "tldp seed")
    assert "allow-weak-seed" not in result.stderr  # it would not help


def test_weak_seed_with_the_opt_in_is_recorded(cli, src, tmp_path):
    result = cli("perturb", src, *PERTURB, "--seed", "42", "--allow-weak-seed", "--out",
                 tmp_path / "weak.npy", "--json")
    assert result.exit_code == 0, result.stderr
    manifest = json.loads(result.stdout)
    assert manifest["seeded"] is True and manifest["weak_seed"] is True
    strong = json.loads(cli("perturb", src, *PERTURB, "--seed", SEED, "--allow-weak-seed", "--out",
                            tmp_path / "strong.npy", "--json").stdout)
    assert strong["seeded"] is True and strong["weak_seed"] is False  # the opt-in alone is not recorded
    unseeded = json.loads(cli("perturb", src, *PERTURB, "--out", tmp_path / "none.npy", "--json").stdout)
    assert unseeded["seeded"] is False and unseeded["weak_seed"] is False


def test_env_and_file_give_the_bytes_of_seed(cli, src, tmp_path, monkeypatch):
    outputs = {}
    outputs["--seed"] = cli("perturb", src, *PERTURB, "--seed", SEED, "--out", tmp_path / "a.npy")
    outputs["--seed-file"] = cli("perturb", src, *PERTURB, "--seed-file",
                                 seed_file(tmp_path / "key.seed", SEED), "--out", tmp_path / "b.npy")
    outputs["upper case"] = cli("perturb", src, *PERTURB, "--seed", SEED.upper(), "--out", tmp_path / "c.npy")
    monkeypatch.setenv("TLDP_SEED", SEED)
    outputs["TLDP_SEED"] = cli("perturb", src, *PERTURB, "--out", tmp_path / "d.npy")
    for name, result in outputs.items():
        assert result.exit_code == 0, (name, result.stderr)
        assert "same seed on another input" in result.stderr, name  # the warning stays
    first = (tmp_path / "a.npy").read_bytes()
    for name in "bcd":
        assert (tmp_path / f"{name}.npy").read_bytes() == first, name
    unseeded = cli("perturb", src, *PERTURB, "--out", tmp_path / "e.npy", "--seed", "")
    assert unseeded.exit_code == 2  # an empty --seed is not "no seed"


def test_the_library_and_the_cli_agree(cli, src, tmp_path):
    assert cli("perturb", src, *PERTURB, "--seed", SEED, "--out", tmp_path / "cli.npy").exit_code == 0
    perturb(PerturbOptions(input=src, eps=1.0, value_range=(0.0, 1.0), mechanism="baseline",
                           out=tmp_path / "lib.npy", seed=SEED))
    assert (tmp_path / "cli.npy").read_bytes() == (tmp_path / "lib.npy").read_bytes()
    # An integer keys the streams as its decimal digits, as --seed N does.
    assert cli("perturb", src, *PERTURB, "--seed", "42", "--allow-weak-seed", "--out",
               tmp_path / "cli42.npy").exit_code == 0
    perturb(PerturbOptions(input=src, eps=1.0, value_range=(0.0, 1.0), mechanism="baseline",
                           out=tmp_path / "lib42.npy", seed=42, allow_weak_seed=True))
    assert (tmp_path / "cli42.npy").read_bytes() == (tmp_path / "lib42.npy").read_bytes()


def test_the_library_enforces_the_rule(src, tmp_path):
    with pytest.raises(UsageError, match="holds only 6 bits.*128 bits"):
        perturb(PerturbOptions(input=src, eps=1.0, value_range=(0.0, 1.0), mechanism="baseline",
                               out=tmp_path / "o.npy", seed=42))
    assert not (tmp_path / "o.npy").exists()
    with pytest.raises(UsageError, match="128 bits"):
        Streams("secure", "abcdef")
    for bad in (-1, 1.5, b"\x01" * 16, "0x" + SEED):
        with pytest.raises(UsageError):
            Streams("secure", bad, allow_weak_seed=True)
    assert Streams("secure", int(SEED, 16) | 1 << 127, allow_weak_seed=True).weak_seed is False  # 128 bits
    assert Streams("secure", int(SEED[::-1], 16) | 1 << 127).weak_seed is False
    assert Streams("secure", SEED).weak_seed is False and Streams().weak_seed is False
    assert Streams("secure", 7, allow_weak_seed=True).weak_seed is True
    seed_repr = repr(Streams("secure", SEED))
    assert SEED not in seed_repr


def test_the_seed_is_nowhere(cli, src, tmp_path, monkeypatch):
    out = tmp_path / "o.npy"
    result = cli("perturb", src, *PERTURB, "--seed", SEED, "--out", out, "--json")
    assert result.exit_code == 0, result.stderr
    manifest = (tmp_path / "o.npy.manifest.json").read_text()
    assert_nowhere(SEED, out.read_bytes(), manifest, result.stdout, result.stderr, " ".join(siblings(tmp_path)))
    monkeypatch.setenv("TLDP_SEED", SEED)
    audit = cli("audit", "--eps", "1", "--elements", "4", "--range", "0:1", "--samples", "20000", "--json")
    sweep = cli("sweep", src, "--eps", "1", "--range", "0:1", "--out", tmp_path / "sweep",
                "--json")
    for result in (audit, sweep):
        assert result.exit_code == 0, result.stderr
        assert_nowhere(SEED, result.stdout, result.stderr)
    assert_nowhere(SEED, *[p.read_bytes() for p in (tmp_path / "sweep").iterdir()])


def test_two_sources_are_a_usage_error(cli, src, tmp_path, monkeypatch):
    key = seed_file(tmp_path / "key.seed", SEED)
    result = cli("perturb", src, *PERTURB, "--seed", SEED, "--seed-file", key)
    assert_one_line_usage_error(result, "--seed and --seed-file")
    monkeypatch.setenv("TLDP_SEED", SEED)
    for given in (("--seed", SEED), ("--seed-file", key)):
        result = cli("perturb", src, *PERTURB, *given)
        assert_one_line_usage_error(result, "$TLDP_SEED")
        assert_nowhere(SEED, result.stderr)
    monkeypatch.setenv("TLDP_SEED", "")  # set but empty: not a source
    assert cli("perturb", src, *PERTURB, "--seed", SEED, "--out", tmp_path / "o.npy").exit_code == 0


def test_seed_file_open_to_others_is_warned_about(cli, src, tmp_path):
    loose = seed_file(tmp_path / "loose.seed", SEED, 0o644)
    result = cli("perturb", src, *PERTURB, "--seed-file", loose, "--out", tmp_path / "a.npy")
    assert result.exit_code == 0, result.stderr
    assert f"warning: other users may read or write the seed file {loose} (mode 0644)" in result.stderr
    assert f"chmod 600 {loose}" in result.stderr
    private = seed_file(tmp_path / "private.seed", SEED)
    result = cli("perturb", src, *PERTURB, "--seed-file", private, "--out", tmp_path / "b.npy")
    assert result.exit_code == 0 and "seed file" not in result.stderr


def test_a_file_that_is_not_a_seed_is_refused(cli, src, tmp_path):
    result = cli("perturb", src, *PERTURB, "--seed-file", src)  # binary
    assert_one_line_usage_error(result, "not a seed file")
    big = seed_file(tmp_path / "big.seed", SEED * 200)
    assert_one_line_usage_error(cli("perturb", src, *PERTURB, "--seed-file", big), "not a seed file")
    missing = cli("perturb", src, *PERTURB, "--seed-file", tmp_path / "missing.seed")
    assert missing.exit_code == 1 and "missing.seed: No such file" in missing.stderr


def test_tldp_seed_prints_a_fresh_128_bit_seed(cli, src, tmp_path):
    seeds = [cli("seed") for _ in range(3)]
    for result in seeds:
        assert result.exit_code == 0 and result.stderr == ""
        assert re.fullmatch(r"[0-9a-f]{32}\n", result.stdout), result.stdout
    assert len({r.stdout for r in seeds}) == 3
    fresh = seed_file(tmp_path / "fresh.seed", seeds[0].stdout.strip())
    result = cli("perturb", src, *PERTURB, "--seed-file", fresh, "--json", "-q")
    assert result.exit_code == 0 and json.loads(result.stdout)["weak_seed"] is False
    assert "Examples:" in cli("seed", "--help").stdout


def test_env_and_file_keep_the_seed_out_of_argv(src, tmp_path):
    """What other users see in /proc/PID/cmdline: the argv of a real process."""
    key = seed_file(tmp_path / "key.seed", SEED)
    outputs = []
    for name, more, env in (("env", [], {"TLDP_SEED": SEED}), ("file", ["--seed-file", str(key)], {})):
        out = tmp_path / f"{name}.npy"
        argv = [sys.executable, "-m", "tldp_cli", "perturb", str(src), *PERTURB, "--out", str(out), *more]
        assert "--seed" not in argv and not any(SEED in arg for arg in argv)
        environ = {k: v for k, v in os.environ.items() if k != "TLDP_SEED"}
        run = subprocess.run(argv, env={**environ, **env}, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        assert_nowhere(SEED, run.stdout, run.stderr)
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]


def test_audit_and_sweep_take_seeds_the_same_way(cli, src, tmp_path, monkeypatch):
    audit = ("audit", "--eps", "1", "--elements", "4", "--range", "0:1", "--samples", "20000", "--json", "-q")
    assert_one_line_usage_error(cli(*audit, "--seed", "7"), "128 bits")
    sweep = ("sweep", src, "--eps", "1", "--range", "0:1", "--json", "-q", "--overwrite")
    assert_one_line_usage_error(cli(*sweep, "--seed", "7", "--out", tmp_path / "s"), "128 bits")
    weak = json.loads(cli(*audit, "--seed", "7", "--allow-weak-seed").stdout)
    assert weak["seeded"] is True and weak["weak_seed"] is True
    by_file = cli(*audit, "--seed-file", seed_file(tmp_path / "key.seed", SEED))
    sweep_by_file = cli(*sweep, "--seed-file", tmp_path / "key.seed", "--out", tmp_path / "s1")
    monkeypatch.setenv("TLDP_SEED", SEED)
    by_env = cli(*audit)
    sweep_by_env = cli(*sweep, "--out", tmp_path / "s2")
    for result in (by_file, by_env, sweep_by_file, sweep_by_env):
        assert result.exit_code == 0, result.stderr
    assert json.loads(by_file.stdout) == json.loads(by_env.stdout)
    assert json.loads(by_env.stdout)["weak_seed"] is False
    errors = [[row["mean_l2_error"] for row in json.loads(r.stdout)["rows"]]
              for r in (sweep_by_file, sweep_by_env)]
    assert errors[0] == errors[1]
    # TLDP_SEED does not concern an evaluation; --seed-file is not its option
    assert cli("perturb", src, *PERTURB, "--out", tmp_path / "p.npy", "-q").exit_code == 0
    assert cli("evaluate", src, tmp_path / "p.npy", "-q").exit_code == 0
    monkeypatch.delenv("TLDP_SEED")
    assert_one_line_usage_error(cli("evaluate", src, tmp_path / "p.npy", "--seed-file", tmp_path / "key.seed"),
                                "No such option: --seed-file")


def test_a_key_names_a_release_s_streams_as_perturb_tensors_always_did():
    """rng.keyed_name, perturb_tensors' `key` and perturb_array's: `key`, NUL, the array's name
    (perturb_tensors' f"{key}\\0{name}", its noise unchanged); no key is the name itself;
    bytes are their own bytes, an int its decimal digits (as integer seeds are)."""
    from tldp_cli.sampling.rng import keyed_name

    assert keyed_name("w", "round 0/client 1") == "round 0/client 1\0w"
    assert keyed_name("w", None) == keyed_name("w", "") == keyed_name("w", b"") == "w"
    assert keyed_name("array", 12) == keyed_name("array", "12") == keyed_name("array", b"12")
    streams = Streams("secure", SEED)
    undecodable = keyed_name("w", b"\xff\x00")
    assert streams.generator(undecodable, 0).random() != streams.generator(keyed_name("w", b"\xfe\x00"), 0).random()
    for bad in (1.5, True, ["a"]):
        with pytest.raises(UsageError, match="key names a batch: a str, bytes or int"):
            keyed_name("w", bad)
    with pytest.raises(UsageError, match="lone surrogate"):
        keyed_name("w", "\ud800")  # generator() could not encode it: refused before any work
