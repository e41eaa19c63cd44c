"""Sharded model folders (formats/sharded_safetensors.py): save_pretrained's shards and
model.safetensors.index.json, one input. Inputs are written as huggingface_hub writes them
(split_state_dict_into_shards_factory, safetensors.numpy; builders.write_sharded_model),
outputs read back with safe_open through the index's weight_map, and, where torch and
transformers are installed, with from_pretrained."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from tests.builders import (SEED, RoundTrip, assert_one_line_error, read_sharded_model, siblings, tree_digest,
                            write_sharded_model)
from tldp_cli.formats import sharded_safetensors

ARGS = ("--eps", "1", "--clip", "0.1")
INDEX = "model.safetensors.index.json"
CONFIG = {"_name_or_path": "/home/alice/patients-model", "architectures": ["GPT2LMHeadModel"],
          "model_type": "gpt2", "n_embd": 16, "n_layer": 2, "tie_word_embeddings": True}
FILES = {"config.json": json.dumps(CONFIG, indent=2), "generation_config.json": '{"bos_token_id": 0}',
         "merges.txt": "#version: 0.2\nh e\n", "vocab.json": '{"he": 0}',
         "README.md": "Fine-tuned on the clinic's notes of 2023.\n"}


def gpt2_like() -> dict[str, np.ndarray]:
    """A tiny GPT-2's parameters: the embedding shared with the head (one array, two names),
    float16 biases, an integer buffer."""
    rng = np.random.default_rng(7)
    wte = rng.normal(0, 0.02, (64, 16)).astype(np.float32)
    tensors = {"transformer.wte.weight": wte,
               "transformer.wpe.weight": rng.normal(0, 0.02, (12, 16)).astype(np.float32)}
    for i in range(3):
        tensors[f"transformer.h.{i}.ln_1.weight"] = np.ones(16, np.float32)
        tensors[f"transformer.h.{i}.attn.c_attn.weight"] = rng.normal(0, 0.02, (16, 48)).astype(np.float32)
        tensors[f"transformer.h.{i}.attn.c_attn.bias"] = rng.normal(0, 0.02, 48).astype(np.float16)
        tensors[f"transformer.h.{i}.mlp.c_fc.weight"] = rng.normal(0, 0.02, (16, 64)).astype(np.float32)
    tensors["transformer.ln_f.weight"] = np.ones(16, np.float32)
    tensors["transformer.h.0.attn.masked_bias"] = np.array([-1e4], np.float32)
    tensors["lm_head.weight"] = wte  # tied: the same array
    tensors["step"] = np.array([5], np.int64)
    return tensors


def model(tmp_path: Path, name: str = "gpt2_tiny", files=FILES) -> Path:
    return write_sharded_model(tmp_path / name, gpt2_like(), max_shard_size=5000, extra_files=files)


def index_of(folder: Path) -> dict:
    return json.loads((folder / INDEX).read_text())


def shard_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.safetensors"))


def run(cli, src: Path, *more, out: Path | None = None):
    return cli("perturb", src, *ARGS, "--seed", SEED, *(("--out", out) if out else ()), *more, "--json")


class ShardedRoundTrip(RoundTrip):
    format = "sharded-safetensors"
    extra_args = ("--clip", "0.1")

    def make_input(self, tmp_path):
        return model(tmp_path)

    def read_arrays(self, path):
        tensors = read_sharded_model(path)
        return {name: tensors[name] for name in ("transformer.wte.weight", "transformer.h.1.attn.c_attn.bias")}

    def assert_same_structure(self, original, perturbed):
        assert shard_names(perturbed) == shard_names(original)
        a, b = index_of(original), index_of(perturbed)
        assert b["weight_map"] == a["weight_map"] and b["metadata"] == a["metadata"]
        for shard in shard_names(original):
            with safe_open(str(original / shard), framework="np") as f, \
                    safe_open(str(perturbed / shard), framework="np") as g:
                assert g.metadata() == {"format": "pt"} and list(g.keys()) == list(f.keys())
                for name in f.keys():
                    assert g.get_slice(name).get_shape() == f.get_slice(name).get_shape()
                    assert g.get_slice(name).get_dtype() == f.get_slice(name).get_dtype()
        assert read_sharded_model(perturbed)["step"] == 5


def test_one_run_gives_the_same_shards_index_and_one_manifest(cli, tmp_path):
    src = model(tmp_path)
    before = tree_digest(src)
    result = run(cli, src)
    assert result.exit_code == 0, result.stderr
    assert tree_digest(src) == before
    out = tmp_path / "gpt2_tiny.tldp"
    assert siblings(tmp_path) == {"gpt2_tiny", "gpt2_tiny.tldp", "gpt2_tiny.tldp.manifest.json"}
    assert len(shard_names(src)) >= 5 and shard_names(out) == shard_names(src)
    index, original = index_of(out), index_of(src)
    assert index["weight_map"] == original["weight_map"]
    tensors = read_sharded_model(out)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    # the tied head: left out of the shards and the index, its entry naming the weight it shares kept
    assert "lm_head.weight" not in index["weight_map"]
    assert index["metadata"]["lm_head.weight"] == "transformer.wte.weight"
    manifest = json.loads(result.stdout)
    assert manifest == json.loads((tmp_path / "gpt2_tiny.tldp.manifest.json").read_text())
    per_tensor = {t["name"] for t in manifest["accounting"]["per_tensor"]}
    floats = {n for n, t in read_sharded_model(src).items() if t.dtype.kind == "f"}
    assert per_tensor == floats  # every tensor of every shard, in one guarantee
    assert manifest["accounting"]["per_file"]["records"] == len(floats)
    assert {Path(i["path"]).name for i in manifest["inputs"]} == set(shard_names(src))
    written = {Path(o["path"]).relative_to(out).as_posix() for o in manifest["outputs"]}
    assert written == set(shard_names(src)) | {INDEX, "config.json", "generation_config.json", "merges.txt",
                                                "vocab.json"}
    for name, value in read_sharded_model(src).items():
        assert tensors[name].dtype == value.dtype and tensors[name].shape == value.shape
        assert np.array_equal(tensors[name], value) == (name not in floats), name


def test_each_tensor_gets_the_noise_it_gets_in_one_file(cli, tmp_path):
    """A tensor is one record whichever shard holds it: the sharded model and the same model
    in one file give the same noise with the same seed, and the same figures."""
    src = model(tmp_path)
    single = tmp_path / "model.safetensors"
    save_file(read_sharded_model(src), str(single), metadata={"format": "pt"})
    sharded_run, single_run = run(cli, src), run(cli, single)
    assert sharded_run.exit_code == 0 and single_run.exit_code == 0, sharded_run.stderr + single_run.stderr
    sharded, one = read_sharded_model(tmp_path / "gpt2_tiny.tldp"), load_file(str(tmp_path / "model.tldp.safetensors"))
    assert sharded.keys() == one.keys()
    for name in one:
        np.testing.assert_array_equal(sharded[name], one[name])
    a, b = json.loads(sharded_run.stdout)["accounting"], json.loads(single_run.stdout)["accounting"]
    assert sorted(a["per_tensor"], key=lambda t: t["name"]) == sorted(b["per_tensor"], key=lambda t: t["name"])
    assert a["per_file"]["epsilon"] == pytest.approx(b["per_file"]["epsilon"], rel=1e-12)


def test_configuration_and_tokenizer_copied_and_listed_free_text_dropped(cli, tmp_path):
    src = model(tmp_path)
    result = run(cli, src)
    manifest = json.loads(result.stdout)
    out = tmp_path / "gpt2_tiny.tldp"
    reasons = {u["name"]: u["reason"] for u in manifest["unperturbed"]}
    assert reasons["config.json"] == reasons["generation_config.json"] == sharded_safetensors.CONFIG_REASON
    assert reasons["merges.txt"] == reasons["vocab.json"] == sharded_safetensors.TOKENIZER_REASON
    dropped = {d["name"]: d["kind"] for d in manifest["dropped"]}
    assert dropped == {"README.md": "file", "config.json@_name_or_path": "configuration key"}
    assert not (out / "README.md").exists()
    assert json.loads((out / "config.json").read_text()) == {k: v for k, v in CONFIG.items() if k != "_name_or_path"}
    for name in ("generation_config.json", "merges.txt", "vocab.json"):
        assert (out / name).read_text() == FILES[name]
    assert "alice" not in "".join(p.read_text(errors="replace") for p in out.rglob("*") if p.is_file())
    assert "dropped 1 file and 1 configuration key" in result.stderr


def test_keep_copies_the_model_card_and_the_name(cli, tmp_path):
    src = model(tmp_path)
    manifest = json.loads(run(cli, src, "--keep", "README.md", "--keep", "config.json@_name_or_path").stdout)
    out = tmp_path / "gpt2_tiny.tldp"
    assert (out / "README.md").read_text() == FILES["README.md"]
    assert (out / "config.json").read_text() == FILES["config.json"]
    kept = [u["name"] for u in manifest["unperturbed"] if u["reason"] == "kept by --keep"]
    assert sorted(kept) == ["README.md", "config.json@_name_or_path"] and "dropped" not in manifest


def test_a_composite_configuration_s_nested_names_are_dropped_too(cli, tmp_path):
    """Regression: a multimodal model's config.json (LLaVA, CLIP, BLIP) nests a configuration
    per part, each with its own _name_or_path; only the top-level one was left out, so
    text_config._name_or_path (a local path naming a person) was copied raw, unlisted."""
    nested = {**CONFIG, "text_config": {"_name_or_path": "/home/alice/text-model", "vocab_size": 64},
              "vision_config": {"name_or_path": "/home/alice/vision", "image_size": 8}}
    src = model(tmp_path, files={**FILES, "config.json": json.dumps(nested, indent=2)})
    manifest = json.loads(run(cli, src).stdout)
    out = tmp_path / "gpt2_tiny.tldp"
    assert "alice" not in (out / "config.json").read_text()
    written = json.loads((out / "config.json").read_text())
    assert written["text_config"] == {"vocab_size": 64} and written["vision_config"] == {"image_size": 8}
    dropped = {d["name"] for d in manifest["dropped"]}
    assert {"config.json@text_config._name_or_path", "config.json@vision_config.name_or_path"} <= dropped
    kept_out = tmp_path / "kept"
    manifest = json.loads(run(cli, src, "--keep", "config.json@text_config._name_or_path", out=kept_out).stdout)
    assert json.loads((kept_out / "config.json").read_text())["text_config"] == nested["text_config"]
    assert "config.json@text_config._name_or_path" in [u["name"] for u in manifest["unperturbed"]]


def test_the_tokenizer_s_local_paths_are_dropped(cli, tmp_path):
    """Regression: transformers 4.x saved tokenizer_config.json with the local paths it loaded
    the tokenizer from, `tokenizer_file` and `special_tokens_map_file` (/home/alice/...), beside
    `name_or_path`; only name_or_path was left out, so the home folder naming a person was
    copied raw, unlisted. Both are left out and listed like it, --keep keeps one."""
    tokenizer = {"model_max_length": 12, "name_or_path": "/home/alice/tok",
                 "tokenizer_file": "/home/alice/.cache/tok/tokenizer.json",
                 "special_tokens_map_file": "/home/alice/.cache/tok/special_tokens_map.json",
                 "tokenizer_class": "GPT2Tokenizer"}
    src = model(tmp_path, files={**FILES, "tokenizer_config.json": json.dumps(tokenizer, indent=2)})
    manifest = json.loads(run(cli, src).stdout)
    out = tmp_path / "gpt2_tiny.tldp"
    assert json.loads((out / "tokenizer_config.json").read_text()) == {"model_max_length": 12,
                                                                       "tokenizer_class": "GPT2Tokenizer"}
    dropped = {d["name"] for d in manifest["dropped"]}
    assert {"tokenizer_config.json@tokenizer_file", "tokenizer_config.json@special_tokens_map_file"} <= dropped
    kept = json.loads(run(cli, src, "--keep", "tokenizer_config.json@tokenizer_file", out=tmp_path / "k").stdout)
    assert json.loads((tmp_path / "k" / "tokenizer_config.json").read_text())["tokenizer_file"] == \
        tokenizer["tokenizer_file"]
    assert "tokenizer_config.json@tokenizer_file" in [u["name"] for u in kept["unperturbed"]]


# A tokenizer as transformers' save_pretrained writes one (tokenization_utils_base.py:
# save_chat_templates, save_pretrained, _save_pretrained): tokenizer_config.json as
# json.dumps(indent=2, sort_keys=True, ensure_ascii=False) + "\n", with its added_tokens_decoder
# (id -> AddedToken state) and, without save_jinja_files, the `chat_template` string;
# with it, chat_template.jinja and additional_chat_templates/NAME.jinja; added_tokens.json the
# added tokens past the vocabulary, {token: id}, written alike. A processor (ProcessorMixin)
# writes chat_template.json, {"chat_template": ...}. transformers is not needed to write them.
SYSTEM_PROMPT = "You are Dr. Alice Smith's assistant at the Northside clinic."
CHAT_TEMPLATE = ("{{ '<|system|>" + SYSTEM_PROMPT + "' }}{% for message in messages %}"
                 "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}{% endfor %}")


def _added(content: str, special: bool) -> dict:
    return {"content": content, "lstrip": False, "normalized": not special, "rstrip": False,
            "single_word": False, "special": special}


def _tokenizer_files(chat_template_key: bool) -> dict[str, str]:
    def dumped(value: dict) -> str:
        return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n"

    config = {"add_prefix_space": False, "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
              "clean_up_tokenization_spaces": False, "model_max_length": 12, "tokenizer_class": "GPT2Tokenizer",
              "unk_token": "<|endoftext|>", "extra_special_tokens": {},
              "added_tokens_decoder": {"63": _added("<|endoftext|>", True), "64": _added("Zorblax", False),
                                       "65": _added("<|system|>", True)}}
    if chat_template_key:
        config["chat_template"] = CHAT_TEMPLATE
    return {**FILES, "tokenizer_config.json": dumped(config),
            "added_tokens.json": dumped({"<|system|>": 65, "Zorblax": 64}),
            **({} if chat_template_key else {"chat_template.jinja": CHAT_TEMPLATE,
                                             "chat_template.json": dumped({"chat_template": CHAT_TEMPLATE})})}


def test_a_chat_template_is_dropped_and_added_tokens_are_named(cli, tmp_path):
    """Regression: a chat template (a written system prompt, which can come from the data) in
    tokenizer_config.json's chat_template, chat_template.jinja, chat_template.json or
    additional_chat_templates/ was copied raw as a tokenizer file; it is left out and listed
    with a reason of its own unless --keep names it. The added tokens (words, from the data
    perhaps) are copied, as the model's ids need them, and the run names them."""
    src = model(tmp_path, files=_tokenizer_files(chat_template_key=True))
    result = run(cli, src)
    assert result.exit_code == 0, result.stderr
    manifest, out = json.loads(result.stdout), tmp_path / "gpt2_tiny.tldp"
    dropped = {d["name"]: d["reason"] for d in manifest["dropped"]}
    assert dropped["tokenizer_config.json@chat_template"] == sharded_safetensors.CHAT_TEMPLATE_REASON
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert "chat_template" not in config and config["added_tokens_decoder"]["64"]["content"] == "Zorblax"
    assert "Alice" not in "".join(p.read_text() for p in out.rglob("*") if p.is_file() and p.suffix != ".safetensors")
    reasons = {u["name"]: u["reason"] for u in manifest["unperturbed"]}
    assert reasons["added_tokens.json"] == sharded_safetensors.ADDED_TOKENS_REASON
    assert (out / "added_tokens.json").read_text() == (src / "added_tokens.json").read_text()
    line = next(line for line in result.stderr.splitlines() if "added token" in line)
    assert "1 added token ('Zorblax')" in line and "<|system|>" not in line
    kept = run(cli, src, "--keep", "tokenizer_config.json@chat_template", out=tmp_path / "k")
    assert json.loads((tmp_path / "k" / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE

    src = model(tmp_path, "jinja", files=_tokenizer_files(chat_template_key=False))
    (src / "additional_chat_templates").mkdir()
    (src / "additional_chat_templates" / "rag.jinja").write_text(CHAT_TEMPLATE)
    manifest = json.loads(run(cli, src).stdout)
    dropped = {d["name"]: d["reason"] for d in manifest["dropped"]}
    for name in ("chat_template.jinja", "chat_template.json", "additional_chat_templates/rag.jinja"):
        assert dropped[name] == sharded_safetensors.CHAT_TEMPLATE_REASON
        assert not (tmp_path / "jinja.tldp" / name).exists()
    kept = json.loads(run(cli, src, "--keep", "chat_template.*", out=tmp_path / "kj").stdout)
    for name in ("chat_template.jinja", "chat_template.json"):
        assert (tmp_path / "kj" / name).read_bytes() == (src / name).read_bytes()
    assert {"chat_template.jinja", "chat_template.json"} <= {u["name"] for u in kept["unperturbed"]}


def test_shard_metadata_as_in_one_file(cli, tmp_path):
    """Each shard's __metadata__: format kept, the rest dropped and listed as SHARD@KEY unless kept."""
    src = model(tmp_path)
    first = shard_names(src)[0]
    tensors = load_file(str(src / first))
    save_file(tensors, str(src / first), metadata={"format": "pt", "source": "clinic notes"})
    manifest = json.loads(run(cli, src).stdout)
    assert {"name": f"{first}@source", "kind": "metadata key",
            "reason": "a __metadata__ entry (free text), not perturbed; only format, which loaders need, "
                      "is kept"} in manifest["dropped"]
    with safe_open(str(tmp_path / "gpt2_tiny.tldp" / first), framework="np") as f:
        assert f.metadata() == {"format": "pt"}
    kept = run(cli, src, "--keep", "*@source", out=tmp_path / "kept")
    assert kept.exit_code == 0, kept.stderr
    with safe_open(str(tmp_path / "kept" / first), framework="np") as f:
        assert f.metadata() == {"format": "pt", "source": "clinic notes"}


def test_index_total_size_is_the_shards(cli, tmp_path):
    src = model(tmp_path)
    index = index_of(src)
    right = index["metadata"]["total_size"]
    index["metadata"]["total_size"] = right + 1000
    index["metadata"]["note"] = "internal run 7"
    (src / INDEX).write_text(json.dumps(index))
    result = run(cli, src)
    assert result.exit_code == 0, result.stderr
    out = index_of(tmp_path / "gpt2_tiny.tldp")
    assert out["metadata"]["total_size"] == right and "note" not in out["metadata"]
    assert f"its total_size {right + 1000} is not the shards' {right} bytes" in result.stderr
    assert {"name": f"{INDEX}@note", "kind": "index metadata key",
            "reason": sharded_safetensors.INDEX_REASON} in json.loads(result.stdout)["dropped"]


def with_total_parameters(src: Path, total) -> None:
    """The index as transformers' save_pretrained writes it: {"total_parameters":
    model.num_parameters(), **split.metadata}."""
    index = index_of(src)
    index["metadata"].pop("total_parameters", None)
    index["metadata"] = {"total_parameters": total, **index["metadata"]}
    (src / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))


def test_index_total_parameters_kept_where_it_can_count_the_shards(cli, tmp_path):
    """transformers' total_parameters counts the model's parameters, not its buffers (here
    masked_bias and step) nor a tied weight twice: kept, under --exclude and --dtype too (the
    output holds every tensor in its dtype). One above the values the shards hold cannot be
    theirs (regression: it was copied as it was): the output's index states that number."""
    src = model(tmp_path)
    tensors = read_sharded_model(src)
    held = sum(t.size for t in tensors.values())
    parameters = held - tensors["transformer.h.0.attn.masked_bias"].size - tensors["step"].size
    with_total_parameters(src, parameters)
    result = run(cli, src, "--exclude", "transformer.h.*", "--dtype", "float64", out=tmp_path / "kept")
    assert result.exit_code == 0, result.stderr
    out = index_of(tmp_path / "kept")
    assert out["metadata"]["total_parameters"] == parameters and "its total_parameters" not in result.stderr
    written = read_sharded_model(tmp_path / "kept")
    assert out["metadata"]["total_size"] == sum(t.nbytes for t in written.values())
    assert sum(t.size for t in written.values()) == held
    for wrong in (10**9, "6802", -1):
        with_total_parameters(src, wrong)
        result = run(cli, src, "--overwrite", out=tmp_path / "o")
        assert result.exit_code == 0, result.stderr
        assert index_of(tmp_path / "o")["metadata"]["total_parameters"] == held
        assert (f"{src / INDEX}: its total_parameters {wrong} is not a count of the shards' {held} values "
                f"(at most that many); the output's index says {held}") in result.stderr


def test_dataset_and_exclude_name_tensors_across_shards(cli, tmp_path):
    src = model(tmp_path)
    result = run(cli, src, "--dataset", "transformer.wte.weight", "--dataset", "transformer.ln_f.weight")
    manifest = json.loads(result.stdout)
    assert sorted(t["name"] for t in manifest["accounting"]["per_tensor"]) == [
        "transformer.ln_f.weight", "transformer.wte.weight"]
    result = run(cli, src, "--exclude", "transformer.h.*", out=tmp_path / "ex")
    manifest = json.loads(result.stdout)
    assert not any(t["name"].startswith("transformer.h.") for t in manifest["accounting"]["per_tensor"])
    before, after = read_sharded_model(src), read_sharded_model(tmp_path / "ex")
    np.testing.assert_array_equal(after["transformer.h.2.mlp.c_fc.weight"], before["transformer.h.2.mlp.c_fc.weight"])


def _break(src: Path, how: str) -> str:
    """Damages the folder `how`; returns what the error must name."""
    index = index_of(src)
    shards = shard_names(src)
    if how == "missing shard":
        (src / shards[-1]).unlink()
        return f"names shard {shards[-1]}, which is not in"
    if how == "tensor in two shards":
        first = load_file(str(src / shards[0]))
        second = load_file(str(src / shards[1]))
        name = next(iter(first))
        save_file({**second, name: first[name]}, str(src / shards[1]))
        return f"tensor {name} is in two shards, {shards[0]} and {shards[1]}"
    if how == "shard not in index":
        save_file({"extra": np.zeros(3, np.float32)}, str(src / "model.safetensors"))
        return "model.safetensors: a safetensors file the index"
    if how == "tensor not in index":
        name = next(n for n, s in index["weight_map"].items() if s == shards[0])
        del index["weight_map"][name]
        (src / INDEX).write_text(json.dumps(index))
        return f"holds tensor {name}, which the index {INDEX} does not list"
    if how == "index maps elsewhere":
        name = next(n for n, s in index["weight_map"].items() if s == shards[0])
        index["weight_map"][name] = shards[1]
        (src / INDEX).write_text(json.dumps(index))
        return f"holds tensor {name}, which the index {INDEX} maps to {shards[1]}"
    if how in ("parent path", "absolute path"):
        outside = src.parent / "outside.safetensors"
        os.replace(src / shards[0], outside)
        name = "../outside.safetensors" if how == "parent path" else str(outside)
        index["weight_map"] = {n: (name if s == shards[0] else s) for n, s in index["weight_map"].items()}
        (src / INDEX).write_text(json.dumps(index))
        return f"shard {name!r} is not a file inside the folder"
    if how == "linked shard":
        os.replace(src / shards[0], src.parent / "blob")
        os.symlink(src.parent / "blob", src / shards[0])
        return f"{shards[0]} is a symbolic link"
    if how == "linked config":
        os.replace(src / "config.json", src.parent / "blob")
        os.symlink(src.parent / "blob", src / "config.json")
        return "config.json is a symbolic link"
    if how == "not JSON":
        (src / INDEX).write_text('{"weight_map": ')
        return "is not valid JSON"
    if how == "no weight_map":
        (src / INDEX).write_text(json.dumps({"metadata": index["metadata"]}))
        return "not a valid checkpoint index (no weight_map"
    if how == "name twice":
        text = (src / INDEX).read_text()
        (src / INDEX).write_text(text.replace('"weight_map": {', '"weight_map": {\n"transformer.wte.weight": '
                                              f'"{shards[1]}",', 1))
        return "names transformer.wte.weight twice"
    if how == "not a safetensors name":
        index["weight_map"]["transformer.wte.weight"] = "pytorch_model.bin"
        (src / INDEX).write_text(json.dumps(index))
        return "shard 'pytorch_model.bin' is not a .safetensors file"
    if how == "two indexes":
        (src / "pytorch_model.safetensors.index.json").write_text(json.dumps(index))
        return "2 checkpoint indexes (model.safetensors.index.json, pytorch_model.safetensors.index.json)"
    if how == "shard cut short":
        (src / shards[2]).write_bytes(b"abc")
        return f"{shards[2]}: not a valid safetensors file (it is shorter than the 8 bytes of its header's length)"
    if how == "damaged shard":
        (src / shards[2]).write_bytes((src / shards[2]).read_bytes()[:-7])
        return f"{shards[2]}: not a valid safetensors file"
    raise AssertionError(how)


BAD = ("missing shard", "tensor in two shards", "shard not in index", "tensor not in index",
       "index maps elsewhere", "parent path", "absolute path", "linked shard", "linked config", "not JSON",
       "no weight_map", "name twice", "not a safetensors name", "two indexes", "shard cut short", "damaged shard")


@pytest.mark.parametrize("how", BAD)
def test_a_bad_folder_is_refused_with_one_line_and_nothing_written(cli, tmp_path, how):
    src = model(tmp_path)
    fragment = _break(src, how)
    before, around = tree_digest(src), siblings(tmp_path)
    result = cli("perturb", src, *ARGS)
    assert_one_line_error(result, 1, fragment)
    assert tree_digest(src) == before and siblings(tmp_path) == around


def unsharded(tmp_path: Path) -> Path:
    """save_pretrained's folder of a model that fits in one file: model.safetensors beside config.json."""
    src = tmp_path / "small"
    src.mkdir()
    tensors = {name: value for name, value in gpt2_like().items() if name != "lm_head.weight"}
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "merges.txt", "README.md"):
        (src / name).write_text(FILES[name])
    return src


def test_an_unsharded_folder_is_a_model_of_one_shard(cli, tmp_path):
    src = unsharded(tmp_path)
    result = run(cli, src)
    assert result.exit_code == 0, result.stderr
    out = tmp_path / "small.tldp"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "merges.txt", "model.safetensors"]
    manifest = json.loads(result.stdout)
    assert [d["name"] for d in manifest["dropped"]] == ["README.md", "config.json@_name_or_path"]
    single = run(cli, src / "model.safetensors", out=tmp_path / "alone.safetensors")
    assert single.exit_code == 0, single.stderr
    a, b = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "alone.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[name], b[name]) for name in a)
    with safe_open(str(out / "model.safetensors"), framework="np") as f:
        assert f.metadata() == {"format": "pt"}


def test_an_unsharded_folder_with_another_safetensors_file_is_refused(cli, tmp_path):
    src = unsharded(tmp_path)
    save_file({"w": np.zeros(4, np.float32)}, str(src / "adapter_model.safetensors"))
    before = siblings(tmp_path)
    assert_one_line_error(cli("perturb", src, *ARGS), 1, "adapter_model.safetensors: a safetensors file beside "
                                                         "model.safetensors, and no index names the shards")
    assert siblings(tmp_path) == before


# A LoRA adapter's configuration as peft writes it: LoraConfig.to_dict() (every field; its
# base model's name_or_path filled in by PeftModel.save_pretrained), json.dumps(indent=2, sort_keys=True)
ADAPTER_CONFIG = {
    "alpha_pattern": {}, "auto_mapping": None, "base_model_name_or_path": "/home/alice/models/clinic-llama",
    "bias": "none", "eva_config": None, "exclude_modules": None, "fan_in_fan_out": False, "inference_mode": True,
    "init_lora_weights": True, "layer_replication": None, "layers_pattern": None, "layers_to_transform": None,
    "loftq_config": {}, "lora_alpha": 16, "lora_bias": False, "lora_dropout": 0.05, "megatron_config": None,
    "megatron_core": "megatron.core", "modules_to_save": None, "peft_type": "LORA", "r": 4, "rank_pattern": {},
    "revision": None, "target_modules": ["q_proj", "v_proj"], "task_type": "CAUSAL_LM", "use_dora": False,
    "use_rslora": False}
MODEL_CARD = ("---\nbase_model: /home/alice/models/clinic-llama\nlibrary_name: peft\n---\n\n# Model Card for "
              "Model ID\n\n### Framework versions\n\n- PEFT 0.17.1")


def lora_weights(seed: int = 3) -> dict[str, np.ndarray]:
    """A LoRA adapter's state dict as get_peft_model_state_dict returns it: lora_A (r, in) and
    lora_B (out, r) of each targeted module, the adapter's name taken out of the keys."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(2):
        for module in ("q_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, 0.02, (4, 32)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.002, (32, 4)).astype(np.float32)
    return tensors


def peft_adapter(folder: Path, seed: int = 3) -> Path:
    """A folder as PeftModel.save_pretrained writes a LoRA adapter (peft's src/peft/peft_model.py,
    save_pretrained; config.py, PeftConfigMixin.save_pretrained; utils/constants.py names the
    files): the model card README.md, adapter_model.safetensors (safe_save_file with metadata
    {"format": "pt"}) and adapter_config.json. peft needs torch, so the files are written here
    with safetensors and json as peft writes them."""
    folder.mkdir(parents=True)
    (folder / "README.md").write_text(MODEL_CARD)
    save_file(lora_weights(seed), str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text(json.dumps(ADAPTER_CONFIG, indent=2, sort_keys=True))
    return folder


def test_a_peft_adapter_folder_is_perturbed_as_a_model_file(cli, tmp_path):
    """Regression: a PEFT adapter folder (adapter_model.safetensors and adapter_config.json) was
    "no images in adapter (found 3 files that are not images)". Its weights are perturbed as a
    model file (one subject, the whole-file figure), the same noise as the file alone; the
    configuration is copied without the base model's local path; safe_open reads the output."""
    src = peft_adapter(tmp_path / "adapter")
    before = tree_digest(src)
    args = ("--eps", "10", "--budget", "record", "--clip", "0.1", "--seed", SEED, "--json")
    result = cli("perturb", src, *args)
    assert result.exit_code == 0, result.stderr
    assert tree_digest(src) == before
    out = tmp_path / "adapter.tldp"
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    with safe_open(str(src / "adapter_model.safetensors"), framework="np") as f, \
            safe_open(str(out / "adapter_model.safetensors"), framework="np") as g:
        assert g.metadata() == {"format": "pt"} and list(g.keys()) == list(f.keys())
        for name in f.keys():
            assert g.get_tensor(name).shape == f.get_tensor(name).shape and g.get_tensor(name).dtype == np.float32
            assert not np.array_equal(g.get_tensor(name), f.get_tensor(name)), name
    config = json.loads((out / "adapter_config.json").read_text())
    assert config == {k: v for k, v in ADAPTER_CONFIG.items() if k != "base_model_name_or_path"}
    assert "alice" not in "".join(p.read_text(errors="replace") for p in out.iterdir())
    manifest = json.loads(result.stdout)
    assert {d["name"] for d in manifest["dropped"]} == {"README.md", "adapter_config.json@base_model_name_or_path"}
    assert {u["name"]: u["reason"] for u in manifest["unperturbed"]} == {
        "adapter_config.json": sharded_safetensors.CONFIG_REASON}
    assert manifest["accounting"]["per_file"]["records"] == 8
    alone = cli("perturb", src / "adapter_model.safetensors", *args[:-1], "--out", tmp_path / "alone.safetensors")
    assert alone.exit_code == 0, alone.stderr
    a, b = load_file(str(out / "adapter_model.safetensors")), load_file(str(tmp_path / "alone.safetensors"))
    assert all(np.array_equal(a[name], b[name]) for name in b)
    kept = cli("perturb", src, *args, "--out", tmp_path / "kept", "--keep", "adapter_config.json@base_model_name_or_path")
    assert kept.exit_code == 0, kept.stderr
    assert json.loads((tmp_path / "kept" / "adapter_config.json").read_text()) == ADAPTER_CONFIG


# A prompt-tuning adapter's configuration as peft writes it (PromptTuningConfig.to_dict(),
# prompt_tuning_init TEXT: the text the prompt starts from, the tokenizer that encodes it and
# its keyword arguments), and a CPT adapter's (CPTConfig: the context's token ids and masks,
# which CPT takes from training examples); sort_keys as save_pretrained writes them.
PROMPT_TUNING_CONFIG = {
    "auto_mapping": None, "base_model_name_or_path": "gpt2", "inference_mode": True, "num_attention_heads": 2,
    "num_layers": 2, "num_transformer_submodules": 1, "num_virtual_tokens": 4, "peft_type": "PROMPT_TUNING",
    "prompt_tuning_init": "TEXT", "prompt_tuning_init_text": "Does Jane Roe, MRN 4471, report chest pain?",
    "revision": None, "task_type": "CAUSAL_LM", "token_dim": 32,
    "tokenizer_kwargs": {"cache_dir": "/home/alice/.cache/tok"}, "tokenizer_name_or_path": "/home/alice/tok"}
CPT_CONFIG = {
    "auto_mapping": None, "base_model_name_or_path": "gpt2", "cpt_mask": [1, 1, 1, 1],
    "cpt_prompt_init": "TEXT", "cpt_token_ids": [44471, 8120, 318, 2589], "cpt_tokens_type_mask": [1, 2, 2, 3],
    "inference_mode": True, "num_virtual_tokens": 4, "opt_loss_decay_factor": 1.0, "opt_projection_epsilon": 0.1,
    "opt_projection_format_epsilon": 0.1, "opt_weighted_loss_type": "none", "peft_type": "CPT", "revision": None,
    "task_type": "CAUSAL_LM", "tokenizer_name_or_path": "/home/alice/tok"}
# A LoRA adapter initialised by CorDA (LoraConfig(init_lora_weights="corda", corda_config=...)):
# its caches' local paths
CORDA_CONFIG = dict(ADAPTER_CONFIG, init_lora_weights="corda", corda_config={
    "cache_file": "/home/alice/clinic/corda_cache.pt", "corda_method": "ipm",
    "covariance_file": "/home/alice/clinic/covariance.pt", "prune_temporary_fields": True,
    "use_float16_for_covariance": False, "verbose": False})


def _without(config: dict, dotted: tuple[str, ...]) -> dict:
    """`config` without the keys `dotted` names (corda_config.cache_file: a nested one)."""
    out = {}
    for key, value in config.items():
        if key in dotted:
            continue
        inner = tuple(d[len(key) + 1:] for d in dotted if d.startswith(key + "."))
        out[key] = _without(value, inner) if inner and isinstance(value, dict) else value
    return out


@pytest.mark.parametrize("config,private", [
    (PROMPT_TUNING_CONFIG, ("prompt_tuning_init_text", "tokenizer_kwargs", "tokenizer_name_or_path")),
    (CPT_CONFIG, ("cpt_mask", "cpt_token_ids", "cpt_tokens_type_mask", "tokenizer_name_or_path")),
    (CORDA_CONFIG, ("corda_config.cache_file", "corda_config.covariance_file"))], ids=["prompt-tuning", "cpt", "corda"])
def test_a_peft_adapters_text_token_ids_and_paths_are_left_out(cli, tmp_path, config, private):
    """Regression: a prompt-tuning adapter initialised from text keeps that text (and CPT the
    token ids of its context, taken from training examples), the tokenizer's local path and
    its keyword arguments in adapter_config.json, and a CorDA-initialised LoRA adapter its
    caches' local paths; adapter_config.json was copied with them raw. They are left out and
    listed, as the base model's path is; --keep copies them."""
    src = tmp_path / "prompt"
    src.mkdir()
    weights = lora_weights() if config["peft_type"] == "LORA" else {  # a prompt's: PromptEmbedding's
        "prompt_embeddings": np.random.default_rng(5).normal(0, 0.02, (4, 32)).astype(np.float32)}
    save_file(weights, str(src / "adapter_model.safetensors"), metadata={"format": "pt"})
    (src / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    args = ("--eps", "10", "--budget", "record", "--clip", "0.1", "--json")
    result = cli("perturb", src, *args)
    assert result.exit_code == 0, result.stderr
    out = tmp_path / "prompt.tldp"
    assert json.loads((out / "adapter_config.json").read_text()) == _without(config, (*private, "base_model_name_or_path"))
    written = b"".join(p.read_bytes() for p in out.iterdir())
    assert not any(marker in written for marker in (b"Jane Roe", b"alice", b"44471"))
    dropped = {d["name"]: d["reason"] for d in json.loads(result.stdout)["dropped"]}
    assert dropped == {f"adapter_config.json@{key}": sharded_safetensors.PROMPT_REASON
                       if key in sharded_safetensors.PROMPT_KEYS else sharded_safetensors.FREE_TEXT_REASON
                       for key in (*private, "base_model_name_or_path")}
    kept = cli("perturb", src, *args, "--out", tmp_path / "kept", *(f"--keep=adapter_config.json@{k}" for k in private))
    assert kept.exit_code == 0, kept.stderr
    assert json.loads((tmp_path / "kept" / "adapter_config.json").read_text()) == _without(
        config, ("base_model_name_or_path",))


def test_a_folder_of_several_peft_adapters_is_refused_naming_the_other(cli, tmp_path):
    """save_pretrained writes every adapter but the default in a folder of its own, under the
    same tensor names: refused, naming it, rather than taken as one model."""
    src = peft_adapter(tmp_path / "adapters")
    peft_adapter(src / "second", seed=4)
    before = siblings(tmp_path)
    assert_one_line_error(cli("perturb", src, *ARGS), 1, str(src / "second" / "adapter_model.safetensors"),
                          "a safetensors file beside adapter_model.safetensors", "perturb it on its own")
    assert siblings(tmp_path) == before
    result = run(cli, src / "second", out=tmp_path / "second.tldp")
    assert result.exit_code == 0, result.stderr


def test_an_adapter_saved_as_a_pickle_is_refused_saying_so(cli, tmp_path):
    """save_pretrained(safe_serialization=False) writes adapter_model.bin (torch.save, a
    pickle) beside adapter_config.json: refused in one line, where it was "no images"."""
    import pickle

    src = peft_adapter(tmp_path / "adapter")
    (src / "adapter_model.safetensors").unlink()
    (src / "adapter_model.bin").write_bytes(pickle.dumps({"lora_A": [0.1]}, protocol=2))
    before = siblings(tmp_path)
    assert_one_line_error(cli("perturb", src, *ARGS), 1, f"{src}: a PEFT adapter folder (adapter_config.json) "
                          "without adapter_model.safetensors", "never a pickle")
    assert siblings(tmp_path) == before


def test_data_never_copied_by_keep(cli, tmp_path):
    src = model(tmp_path)
    np.save(src / "training_stats.npy", np.zeros(3))
    result = cli("perturb", src, *ARGS, "--keep", "training_stats.npy")
    assert_one_line_error(result, 2, "training_stats.npy: holds npy data", "never copies it raw")
    assert not (tmp_path / "gpt2_tiny.tldp").exists()


def torch_saved(path: Path, obj) -> Path:
    """What torch.save writes (its zip format, the default since PyTorch 1.6): torch's own where it
    is installed, else the same layout by hand: ARCHIVE/data.pkl first, then byteorder and version,
    members stored uncompressed."""
    try:
        import torch
    except ImportError:
        import pickle
        import zipfile

        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
            archive.writestr("archive/data.pkl", pickle.dumps(obj, protocol=2))
            archive.writestr("archive/byteorder", "little")
            archive.writestr("archive/version", "3\n")
    else:
        torch.save(obj, path)
    return path


@pytest.mark.parametrize("name", ["training_args.bin", "optimizer.pt"])
def test_a_torch_checkpoint_beside_an_adapter_is_never_copied_and_named_for_what_it_is(cli, tmp_path, name):
    """Trainer saves training_args.bin (the TrainingArguments, output_dir and hub_token among
    them) and optimizer.pt (Adam's moments of the gradients, computed from the training data)
    with torch.save, a pickle in a zip: dropped, and refused when --keep names it. Regression:
    the refusal said "holds npz data, which tldp perturbs on its own" (npz detects the zip only
    to refuse it)."""
    src = peft_adapter(tmp_path / "adapter")
    torch_saved(src / name, {"output_dir": "/home/alice/clinic-run", "exp_avg": [0.1, 0.2]})
    result = cli("perturb", src, *ARGS, "--json")
    assert result.exit_code == 0, result.stderr
    assert name in {d["name"] for d in json.loads(result.stdout)["dropped"]}
    assert not (tmp_path / "adapter.tldp" / name).exists()
    kept = cli("perturb", src, *ARGS, "--out", tmp_path / "kept", "--keep", name)
    assert_one_line_error(kept, 2, f"{name}: holds a PyTorch checkpoint", "never copies it raw")
    assert not (tmp_path / "kept").exists()


def test_a_tokenizer_file_that_holds_a_pickle_is_refused(cli, tmp_path):
    import pickle

    src = model(tmp_path)
    (src / "tokenizer.model").write_bytes(pickle.dumps({"vocab": ["he"]}, protocol=4))
    before = siblings(tmp_path)
    assert_one_line_error(cli("perturb", src, *ARGS), 1, "tokenizer.model: holds a Python pickle")
    assert siblings(tmp_path) == before


def test_resume_is_refused_clearly(cli, tmp_path):
    src = model(tmp_path)
    result = cli("perturb", src, *ARGS, "--resume")
    assert_one_line_error(result, 2, "--resume", "not sharded-safetensors")


def test_a_failing_run_leaves_nothing(cli, tmp_path):
    """Values outside the declared range stop the run after shards were begun: no output."""
    src = model(tmp_path)
    around = siblings(tmp_path)
    result = cli("perturb", src, "--eps", "1", "--range", "-0.01:0.01")
    assert_one_line_error(result, 1, "outside the declared range")
    assert siblings(tmp_path) == around


def test_plan_reads_the_headers(cli, tmp_path):
    src = model(tmp_path)
    result = cli("plan", src, *ARGS, "--json")
    assert result.exit_code == 0, result.stderr
    plan = json.loads(result.stdout)
    perturbed = json.loads(run(cli, src).stdout)["accounting"]["per_tensor"]
    assert plan["accounting"]["per_file"]["records"] == len(perturbed)


@pytest.mark.parametrize("max_shard_size,dtype,shards", [
    ("30KB", "float32", 7), ("5GB", "float32", 1), ("15KB", "bfloat16", 7)])
def test_from_pretrained_loads_the_output(cli, tmp_path, max_shard_size, dtype, shards):
    """transformers' GPT-2 in 7 shards, in one file, and in bfloat16: the output loads, its
    head tied to the perturbed embedding, every tensor in its dtype."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file as load_torch

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=3, n_head=2, vocab_size=100, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    src = tmp_path / "gpt2_tiny"
    transformers.GPT2LMHeadModel(config).to(getattr(torch, dtype)).save_pretrained(src, max_shard_size=max_shard_size)
    assert len(shard_names(src)) == shards
    result = cli("perturb", src, *ARGS, "--seed", SEED)
    assert result.exit_code == 0, result.stderr
    out = tmp_path / "gpt2_tiny.tldp"
    before = transformers.GPT2LMHeadModel.from_pretrained(src, dtype=getattr(torch, dtype))
    after = transformers.GPT2LMHeadModel.from_pretrained(out, dtype=getattr(torch, dtype))
    wte = after.transformer.wte.weight
    assert after.lm_head.weight.data_ptr() == wte.data_ptr() and wte.dtype == getattr(torch, dtype)
    assert not torch.equal(wte, before.transformer.wte.weight)
    written = {name: t for shard in shard_names(out) for name, t in load_torch(str(out / shard)).items()}
    assert torch.equal(wte, written["transformer.wte.weight"])
    with torch.no_grad():
        logits = after(torch.arange(8)[None]).logits
    assert torch.isfinite(logits).all()
