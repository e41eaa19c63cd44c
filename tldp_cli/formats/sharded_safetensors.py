"""Sharded model folders: what `save_pretrained` (transformers) and huggingface_hub's
`save_torch_state_dict` write for a model too large for one file, the tensors split over
shard files (`model-00001-of-00007.safetensors`, ...) and an index,
`model.safetensors.index.json`, whose `weight_map` says which shard holds each tensor
and whose `metadata.total_size` is their bytes; beside them the configuration and the
tokenizer. A model that fits in one file is saved as `model.safetensors` beside
`config.json`, without an index: such a folder is read too, as a model of one shard (its
output has no index either), and so is a PEFT adapter's folder (peft's save_pretrained:
`adapter_model.safetensors` beside `adapter_config.json`).

One folder is one input: one run, one output folder, one manifest. The model is read as
the single-file safetensors format reads a checkpoint: each tensor, whichever shard holds
it, is one record of its own (names are unique across the shards, so the noise of a
tensor is the same as in a single file holding the model), and the whole model is one
release, the manifest's per_file figure composing every tensor of every shard. Each shard
is written as safetensors_file writes a file (formats/safetensors_io.py): its header byte
for byte but `__metadata__`, of which only `format` is kept (and the keys --keep names,
as SHARD@KEY); the shards keep their names and place, and the index its `weight_map`,
with `total_size` the shards' tensors' bytes and transformers' `total_parameters` (the
model's parameters, not its buffers) kept where it can count them: one above the values the
shards hold is replaced by that number.

Tied weights. safetensors cannot store two names over the same bytes (the library refuses
overlapping offsets), so a tied weight is saved once: save_pretrained leaves the tied name
out of the shards and the index (from_pretrained ties it again from the configuration),
and save_torch_state_dict adds an index metadata entry naming the weight it shares
(`"lm_head.weight": "transformer.wte.weight"`). Both come through: the same weight_map,
and those entries kept as structure. Two names holding equal bytes are two tensors, each
perturbed: tying them by their values would make the release's structure depend on the
data, which the certified figures do not cover.

What is not perturbed follows the rule of formats/leftovers.py. The configuration
(CONFIG_FILES: architecture and settings, structure loaders need) and the tokenizer
(TOKENIZER_FILES: loaders need it, but its vocabulary is learned from text) are copied and
listed in the manifest's `unperturbed`, each with its reason; their free-text keys
(FREE_TEXT_KEYS: `_name_or_path`, `tokenizer_file`, ..., which can be local paths; a PEFT
prompt-tuning adapter's initial text and its token ids; a chat template, CHAT_TEMPLATE_KEYS)
are left out and listed, as FILE@KEY, unless --keep names them; so are a chat template's
files (CHAT_TEMPLATE_FILES, CHAT_TEMPLATE_FOLDER). The tokens added to the vocabulary are
copied (the model's ids need them) and named in a message. Every other file (a model card, training arguments)
is left out and listed unless --keep names it; a file holding data (a pickle, another
model file) is never copied raw. Other index metadata is left out and listed as
INDEX@KEY.

Refused, with one line and nothing written: an index that is not JSON or lacks its
weight_map, a shard name that leaves the folder (`../`, an absolute path) or is not a
.safetensors file, a shard missing, a tensor in two shards, a tensor the index maps
elsewhere or not at all, a shard the index does not name, and symbolic links anywhere in
the folder (a Hugging Face cache snapshot links to its blobs).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import numpy as np

from tldp_cli import formats
from tldp_cli.errors import InputError, UsageError, reason_of
from tldp_cli.files.checked_io import flushed_files, json_value, open_regular, path_in_output, writing
from tldp_cli.files.output import removed_during_run
from tldp_cli.formats import (ArrayJob, DocRow, Format, FormatOptions, Reader, Writer, folder_files,
                              folder_output, leftovers, tensor_files)
from tldp_cli.formats.safetensors_io import (METADATA_REASON, STRUCTURAL_METADATA, Entry, ReadParts, ReadTensor,
                                             TensorBlocks, header_with, parse, start_output)

NAME = "sharded-safetensors"
INDEX_SUFFIX = ".safetensors.index.json"
SHARD_SUFFIX = ".safetensors"
SINGLE = "model.safetensors"  # save_pretrained's one shard, without an index, beside config.json
# A PEFT adapter's save_pretrained (peft_model.py; utils/constants.py: SAFETENSORS_WEIGHTS_NAME, CONFIG_NAME): its
# weights in one file, without an index, beside its configuration
ADAPTER, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
MAX_INDEX = 64 << 20  # an index is names: far below this even for the largest models
CONFIG_FILES = ("config.json", "generation_config.json", "preprocessor_config.json", "processor_config.json",
                ADAPTER_CONFIG)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model")
# A chat template (transformers' save_pretrained: the `chat_template` key of tokenizer_config.json, or
# chat_template.jinja and additional_chat_templates/NAME.jinja; a processor's chat_template.json) is
# written text, a system prompt perhaps taken from the data: left out unless --keep names it.
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
CHAT_TEMPLATE_FOLDER = "additional_chat_templates/"
CHAT_TEMPLATE_KEYS = ("chat_template",)
ADDED_TOKENS = "added_tokens.json"  # {token: id}, the tokens added to the vocabulary (save_pretrained)
# Keys that hold a name or a local path (transformers 4.x saved the paths it loaded a tokenizer
# from, tokenizer_file and special_tokens_map_file, in tokenizer_config.json).
# A PEFT adapter's configuration names its base model by name or local path; a prompt-tuning
# adapter initialised from text (peft's PromptTuningConfig, CPTConfig) holds that text, or its
# token ids, and the tokenizer's name or path and keyword arguments (a cache folder, a token);
# a LoRA adapter initialised by CorDA the local paths of its caches (corda_config).
PROMPT_KEYS = ("prompt_tuning_init_text", "cpt_token_ids", "cpt_mask", "cpt_tokens_type_mask")
FREE_TEXT_KEYS = ("_name_or_path", "name_or_path", "_commit_hash", "tokenizer_file", "special_tokens_map_file",
                  "base_model_name_or_path", "tokenizer_name_or_path", "tokenizer_kwargs", "cache_file",
                  "covariance_file", *PROMPT_KEYS, *CHAT_TEMPLATE_KEYS)
STRUCTURAL_INDEX = ("total_size", "total_parameters")
CONFIG_REASON = "model configuration: the architecture and settings loaders need, structure rather than data"
TOKENIZER_REASON = "tokenizer: loaders need it; its vocabulary is learned from text, which it can echo"
FILE_REASON = "a file tldp does not perturb, not a configuration or tokenizer file loaders need"
FREE_TEXT_REASON = "free text (a name or local path), not perturbed"
PROMPT_REASON = "a prompt's text, or its token ids (CPT takes them from training examples), not perturbed"
CHAT_TEMPLATE_REASON = ("a chat template: written text (a system prompt, examples) that can come from the data, "
                        "not perturbed; a chat model's output loads without it, apply_chat_template needs it")
ADDED_TOKENS_REASON = ("tokenizer: the tokens added to its vocabulary (words, which can come from the training "
                       "data), copied because the model's token ids need them; the run names them")
INDEX_REASON = ("an index metadata entry, not perturbed; only total_size, total_parameters and tied "
                "weights' entries, which loaders need, are kept")
LINK_HINT = ("tldp reads only the regular files inside a model folder (a Hugging Face cache snapshot links to "
             "its blobs: download with local_dir=, or copy it with cp -rL)")


def default_output(path: Path) -> Path:
    return folder_output(path)


def can_open(path: Path) -> bool:
    """A folder with a `*.safetensors.index.json`, or `model.safetensors` and `config.json`, or a
    PEFT adapter's `adapter_config.json` (beside its `adapter_model.safetensors`, or the
    reader says what is missing), at its top (links too: the reader refuses them)."""
    try:
        names = {entry.name for entry in os.scandir(path)} if path.is_dir() else set()
    except OSError:
        return False
    return any(name.endswith(INDEX_SUFFIX) for name in names) or {SINGLE, CONFIG_FILES[0]} <= names or \
        ADAPTER_CONFIG in names


def _files(root: Path) -> list[str]:
    """The relative POSIX paths of the regular files under `root`, sorted; a link or
    anything but a file or folder is refused (formats.folder_files)."""
    files, links = folder_files(root)
    if links:
        raise InputError(f"{root}: {links[0]} is a symbolic link; {LINK_HINT}")
    return files


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _Duplicate(key)
        seen[key] = value
    return seen


class _Duplicate(Exception):
    pass


def _read_index(path: Path) -> dict[str, Any]:
    """The index as JSON: an object with a weight_map of tensor names to shard file names."""
    try:
        with open_regular(path, follow_links=False) as f:
            text = f.read(MAX_INDEX + 1)
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({reason_of(exc)})") from None
    if len(text) > MAX_INDEX:
        raise InputError(f"{path}: larger than {MAX_INDEX >> 20} MB, which no checkpoint index is")
    json_value(text, str(path))  # refuses what is not JSON, or nests too deep
    try:
        index = json.loads(text, object_pairs_hook=_no_duplicates)
    except _Duplicate as exc:
        raise InputError(f"{path}: not a valid checkpoint index (it names {exc.args[0]} twice)") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise InputError(f"{path}: not a valid checkpoint index (no weight_map object of tensor names "
                         "and shard files)")
    if not all(isinstance(shard, str) for shard in weight_map.values()):
        raise InputError(f"{path}: not a valid checkpoint index (a weight_map value is not a file name)")
    if not isinstance(index.get("metadata", {}), dict):
        raise InputError(f"{path}: not a valid checkpoint index (its metadata is not an object)")
    return index


def _check_shard_name(index: Path, name: str) -> None:
    """A shard's name stays inside the folder and names a safetensors file."""
    win = PureWindowsPath(name)
    if not name or win.drive or win.root or ".." in win.parts or PurePosixPath(name).is_absolute():
        raise InputError(f"{index}: shard {name!r} is not a file inside the folder (an absolute path or "
                         "'..'); tldp reads only the model folder's own files")
    if not name.endswith(SHARD_SUFFIX):
        raise InputError(f"{index}: shard {name!r} is not a {SHARD_SUFFIX} file")


@dataclass
class _Shard:
    rel: str  # its path in the folder (and in the output)
    header: bytes
    metadata: dict[str, str]
    entries: list[Entry]
    out_header: bytes = b""

    @property
    def data_start(self) -> int:
        return len(self.header)


def _shards(root: Path, index_rel: str, weight_map: dict[str, str], files: list[str]) -> list[_Shard]:
    """The shards the index names, read and checked against it."""
    index = root / index_rel
    names = sorted(set(weight_map.values()))
    for name in names:
        _check_shard_name(index, name)
        if name not in files:
            raise InputError(f"{index}: names shard {name}, which is not in {root}")
    named = set(names)
    for rel in files:
        if rel.lower().endswith(SHARD_SUFFIX) and rel not in named:
            raise InputError(f"{root / rel}: a safetensors file the index {index_rel} does not name (a shard of "
                             "another save?); remove it, or add its tensors to the index")
    shards = [_Shard(name, *parse(root / name)) for name in names]
    holder: dict[str, str] = {}
    for shard in shards:
        for entry in shard.entries:
            name = entry.tensor.name
            if name in holder:
                raise InputError(f"{root}: tensor {name} is in two shards, {holder[name]} and {shard.rel}")
            holder[name] = shard.rel
            if weight_map.get(name) != shard.rel:
                where = "does not list" if name not in weight_map else f"maps to {weight_map[name]}"
                raise InputError(f"{root / shard.rel}: holds tensor {name}, which the index {index_rel} {where}")
    for name, rel in weight_map.items():
        if name not in holder:
            raise InputError(f"{index}: maps tensor {name} to {rel}, which does not hold it")
    return shards


def _single(root: Path, files: list[str]) -> list[_Shard]:
    """A folder without an index: its one shard, model.safetensors (or a PEFT adapter's
    adapter_model.safetensors)."""
    found = [name for name in (SINGLE, ADAPTER) if name in files]
    if not found and ADAPTER_CONFIG in files:
        raise InputError(f"{root}: a PEFT adapter folder ({ADAPTER_CONFIG}) without {ADAPTER}; tldp reads an "
                         "adapter saved as safetensors (save_pretrained's default), never a pickle such as "
                         "adapter_model.bin")
    if not found:
        raise InputError(f"{root}: no checkpoint index (*{INDEX_SUFFIX}) and no {SINGLE}; a model folder "
                         f"holds the index of its shards, or its one {SINGLE} (a PEFT adapter: {ADAPTER})")
    single = found[0]
    for rel in files:
        if rel.lower().endswith(SHARD_SUFFIX) and rel != single:
            raise InputError(f"{root / rel}: a safetensors file beside {single}, and no index names the shards "
                             f"of the model; remove it, or perturb it on its own")
    return [_Shard(single, *parse(root / single))]


def _json_object(path: Path, text: bytes) -> dict | None:
    """A JSON file's top-level object, or None for other files and JSON of other kinds."""
    if not path.name.endswith(".json"):
        return None
    value = json_value(text, str(path))
    return value if isinstance(value, dict) else None


def _read(path: Path) -> bytes:
    try:
        with open_regular(path, follow_links=False) as f:
            return f.read()
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({reason_of(exc)})") from None


class ShardedReader(Reader):
    format = NAME
    records_are_tensors = True  # the manifest gets per-tensor figures, and the whole model's
    keeps_dtypes = True  # each tensor written back in its dtype

    def __init__(self, path: Path, options: FormatOptions):
        self.path = path
        files = _files(path)
        indexes = [rel for rel in files if "/" not in rel and rel.endswith(INDEX_SUFFIX)]
        if len(indexes) > 1:
            raise InputError(f"{path}: {len(indexes)} checkpoint indexes ({', '.join(indexes)}); a sharded model "
                             f"folder holds one *{INDEX_SUFFIX}")
        self.index_rel = indexes[0] if indexes else None  # None: the one model.safetensors
        if self.index_rel is None:
            self.index: dict[str, Any] = {}
            self.shards = _single(path, files)
        else:
            self.index = _read_index(path / self.index_rel)
            self.shards = _shards(path, self.index_rel, self.index["weight_map"], files)
        tensors = [e.tensor for shard in self.shards for e in shard.entries]
        chosen, messages, unperturbed = tensor_files.select(path, tensors, options.datasets, options.exclude)
        left = leftovers.Leftovers(list(options.keep), unperturbed=unperturbed)
        left.considered(t.name for t in tensors)
        for shard in self.shards:
            kept = {key: value for key, value in shard.metadata.items()
                    if left.attribute(shard.rel, key, STRUCTURAL_METADATA, "metadata key", METADATA_REASON)}
            shard.out_header = shard.header if kept == shard.metadata else header_with(shard.header, kept)
        self.index_text, note = self._index_out(self.index_rel, left) if self.index_rel else (b"", [])
        self.copies = self._other_files(files, left)  # rel -> the bytes to write
        note += _added_tokens_note(path, self.copies)
        left.check(path)
        self.manifest_extra = left.manifest_extra()
        in_shards = f"of {path.name} ({formats.plural(len(self.shards), 'shard')}) "
        self.messages = [message.replace(f"of {path.name} ", in_shards) for message in messages] + note
        names = {t.name for t in chosen}
        self.jobs = [tensor_files.job(path / shard.rel, NAME, e.tensor,
                                      ReadTensor(path / shard.rel, e, shard.data_start),
                                      ReadParts(path / shard.rel, e, shard.data_start))
                     for shard in self.shards for e in shard.entries if e.tensor.name in names]

    def _index_out(self, index_rel: str, left: leftovers.Leftovers) -> tuple[bytes, list[str]]:
        """The output's index: the same weight_map, total_size the shards' tensors' bytes, the
        structural metadata (tied weights' entries too); and the message if total_size changed."""
        weight_map = self.index["weight_map"]
        total = sum(e.end - e.begin for shard in self.shards for e in shard.entries)
        metadata, notes = {}, []
        for key, value in self.index.get("metadata", {}).items():
            tie = key not in weight_map and isinstance(value, str) and value in weight_map
            if left.attribute(index_rel, key, (*STRUCTURAL_INDEX, *([key] if tie else [])),
                              "index metadata key", INDEX_REASON):
                metadata[key] = value
        if metadata.get("total_size", total) != total:
            notes.append(f"{self.path / index_rel}: its total_size {metadata['total_size']} is not the "
                         f"shards' {total} bytes of tensors; the output's index says {total}")
        metadata["total_size"] = total
        notes += self._total_parameters(index_rel, metadata)
        out: dict[str, Any] = {}
        for key, value in self.index.items():
            if key in ("metadata", "weight_map"):
                out[key] = metadata if key == "metadata" else value
            elif left.attribute(index_rel, key, (), "index key", INDEX_REASON):
                out[key] = value
        out.setdefault("metadata", metadata)
        return (json.dumps(out, indent=2) + "\n").encode(), notes

    def _total_parameters(self, index_rel: str, metadata: dict[str, Any]) -> list[str]:
        """transformers' total_parameters (the model's num_parameters(): its buffers and a tied
        weight's second name are not counted) is at most the values the shards hold; one that
        is not a count, or more than that, is not these files': the output's index states the
        values the shards hold, and the message says so."""
        held = sum(e.tensor.size for shard in self.shards for e in shard.entries)
        given = metadata.get("total_parameters")
        if given is None or (isinstance(given, int) and not isinstance(given, bool) and 0 <= given <= held):
            return []
        metadata["total_parameters"] = held
        return [f"{self.path / index_rel}: its total_parameters {given} is not a count of the shards' "
                f"{held} values (at most that many); the output's index says {held}"]

    def _other_files(self, files: list[str], left: leftovers.Leftovers) -> dict[str, bytes]:
        """The files beside the shards and the index that the output holds, by relative path,
        with their content (free-text keys left out); the others listed as dropped."""
        shards = {shard.rel for shard in self.shards}
        copies = {}
        for rel in files:
            if rel in shards or rel == self.index_rel:
                continue
            kept = left.kept(rel)
            reason = (CONFIG_REASON if rel in CONFIG_FILES else ADDED_TOKENS_REASON if rel == ADDED_TOKENS
                      else TOKENIZER_REASON if rel in TOKENIZER_FILES else leftovers.KEPT if kept else None)
            if reason is None:
                chat = rel in CHAT_TEMPLATE_FILES or rel.startswith(CHAT_TEMPLATE_FOLDER)
                left.drop(rel, "file", CHAT_TEMPLATE_REASON if chat else FILE_REASON)
                continue
            data = formats.data_file(self.path / rel)
            if data is not None:  # --keep names it (a usage error), or a configuration's name does
                error = UsageError if reason == leftovers.KEPT else InputError
                raise error(f"{self.path / rel}: holds {data}; tldp never copies it raw")
            left.copied(rel, "file", reason)
            copies[rel] = self._without_free_text(rel, left)
        return copies

    def _without_free_text(self, rel: str, left: leftovers.Leftovers) -> bytes:
        text = _read(self.path / rel)
        document = _json_object(self.path / rel, text)
        if document is None or rel in CHAT_TEMPLATE_FILES:  # kept by --keep as a whole
            return text
        kept = _without_keys(rel, document, "", left)
        if kept == document:
            return text
        return (json.dumps(kept, indent=2, ensure_ascii=False) + "\n").encode()

    def arrays(self) -> list[ArrayJob]:
        return self.jobs

    def close(self) -> None:
        pass


def _without_keys(rel: str, document: dict, prefix: str, left: leftovers.Leftovers) -> dict:
    """`document` without its FREE_TEXT_KEYS, at any depth: a composite model's configuration
    nests one per part (text_config._name_or_path), named `rel@text_config._name_or_path`."""
    structural = [prefix + key for key in document if key not in FREE_TEXT_KEYS]
    kept = {}
    for key, value in document.items():
        reason = (PROMPT_REASON if key in PROMPT_KEYS else CHAT_TEMPLATE_REASON if key in CHAT_TEMPLATE_KEYS
                  else FREE_TEXT_REASON)
        if not left.attribute(rel, prefix + key, structural, "configuration key", reason):
            continue
        kept[key] = _without_keys(rel, value, f"{prefix}{key}.", left) if isinstance(value, dict) else value
    return kept


def _added_tokens_note(root: Path, copies: dict[str, bytes]) -> list[str]:
    """The line naming the tokens added to the tokenizer's vocabulary that the output holds
    (copied: the model's token ids need them, but they are words that can come from the data):
    added_tokens.json's, and those tokenizer_config.json (added_tokens_decoder) and
    tokenizer.json (added_tokens) hold, but for the ones they mark special (<pad>, <|im_start|>)."""
    def field(rel: str, key: str | None, kind: type) -> Any:
        value = json.loads(copies[rel]) if rel in copies else {}
        value = value.get(key) if key and isinstance(value, dict) else value
        return value if isinstance(value, kind) else kind()

    entries = [*field("tokenizer_config.json", "added_tokens_decoder", dict).values(),
               *field("tokenizer.json", "added_tokens", list)]
    entries = [e for e in entries if isinstance(e, dict) and isinstance(e.get("content"), str)]
    special = {e["content"] for e in entries if e.get("special")}
    added = [*field(ADDED_TOKENS, None, dict), *(e["content"] for e in entries)]
    words = [token for i, token in enumerate(added) if token not in special and token not in added[:i]]
    if not words:
        return []
    shown = ", ".join(repr(w) for w in words[:10]) + (f" and {len(words) - 10} more" if len(words) > 10 else "")
    return [f"{root}: the tokenizer's {formats.plural(len(words), 'added token')} ({shown}) copied raw: words added "
            "to its vocabulary, which can come from the training data, kept because the model's token ids need "
            "them; check them before the release"]


def open_reader(path: Path, options: FormatOptions) -> ShardedReader:
    return ShardedReader(path, options)


@dataclass(frozen=True)
class _Blocks:
    """Writes a perturbed tensor into its shard. Picklable (Dask workers)."""

    shard_of: dict  # tensor name -> its shard's TensorBlocks

    def __call__(self, job: ArrayJob, start: int, block: np.ndarray) -> None:
        self.shard_of[job.name](job, start, block)

    def part(self, job: ArrayJob, record: int, first: int, values: np.ndarray) -> None:
        self.shard_of[job.name].part(job, record, first, values)


class ShardedWriter(Writer):
    def __init__(self, reader: ShardedReader, tmp_path: Path, dtype: np.dtype):
        self.root = tmp_path
        chosen = {job.name for job in reader.jobs}
        tensors = [e.tensor for shard in reader.shards for e in shard.entries if e.tensor.name in chosen]
        variances = tensor_files.variances(tensors)
        self.postprocessing = tensor_files.postprocessing(tensors, dtype, variances)
        self.output_dtype = tensor_files.output_dtype(tensors)
        index = {reader.index_rel: reader.index_text} if reader.index_rel else {}
        self.expected = [shard.rel for shard in reader.shards] + list(index) + list(reader.copies)
        with writing(tmp_path):
            tmp_path.mkdir()
        shard_of: dict[str, TensorBlocks] = {}
        for shard in reader.shards:
            blocks = start_output(reader.path / shard.rel, shard.data_start, shard.entries, shard.out_header,
                                  self._target(shard.rel), chosen, variances)
            shard_of.update((e.tensor.name, blocks) for e in shard.entries)
        self._blocks = _Blocks(shard_of)
        for rel, data in {**index, **reader.copies}.items():
            target = self._target(rel)
            with writing(target), open(target, "xb") as out:
                out.write(data)

    def _target(self, rel: str) -> Path:
        return path_in_output(self.root, rel)

    def write(self, job: ArrayJob, start: int, block: np.ndarray) -> None:
        self._blocks(job, start, block)

    def block_writer(self) -> _Blocks:
        return self._blocks

    def part_writer(self):
        return self._blocks.part

    def finish(self) -> None:
        """Every file of the output is there (one removed during the run fails it)."""
        for rel in self.expected:
            if not (self.root / rel).is_file():
                raise removed_during_run(self.root / rel)

    def close(self) -> list[Path]:
        return flushed_files(self.root, ())


def create_writer(reader: ShardedReader, tmp_path: Path, dtype: np.dtype, options: FormatOptions) -> ShardedWriter:
    return ShardedWriter(reader, tmp_path, dtype)


def output_bytes(jobs: list[ArrayJob], dtype: np.dtype, options: FormatOptions) -> int:
    """The least the output needs on disk: the shards holding the perturbed tensors, whole
    (every tensor keeps its dtype)."""
    total = 0
    for shard in {job.source["path"] for job in jobs}:
        try:
            total += os.stat(shard).st_size
        except OSError:
            pass  # reading it says why
    return total


def is_earlier_output(path: Path, reader: ShardedReader) -> bool:
    """A folder whose manifest names it is an earlier output if it holds this input's shards,
    index and copied files, nothing else."""
    expected = ({shard.rel for shard in reader.shards} | {reader.index_rel} | set(reader.copies)) - {None}
    try:
        return set(_files(path)) <= expected
    except InputError:
        return False


FORMAT = Format(
    name=NAME, title="sharded model folder", folder=True, member_noun="tensor",
    selects_arrays=True, honours_exclude=True, honours_keep=True,
    can_open=can_open, default_output=default_output, open_reader=open_reader, create_writer=create_writer,
    output_bytes=output_bytes, earlier_output=is_earlier_output,
    docs=(DocRow("sharded model folder (`save_pretrained`: safetensors shards and "
                 "`model.safetensors.index.json`, or one `model.safetensors`; a PEFT adapter's "
                 "`adapter_model.safetensors`)",
                 "a folder with a `*.safetensors.index.json`, or `model.safetensors` and `config.json`, or "
                 "a PEFT adapter's `adapter_config.json`, at its top",
                 "`tldp perturb gpt2_tiny --eps 1 --clip 0.1`",
                 "`gpt2_tiny.tldp/`: the same shards (each as a `.safetensors` file is written) and index "
                 "`weight_map`, the configuration and tokenizer copied ([below](#sharded-model-folders))"),),
)
