"""`extract.backend: import`: hidden states a serving engine extracted, taken into the lineage as our shards.

At Kimi-K2.5 size the target runs only under a serving engine with tensor parallelism, so users extract with the
peers' engine-backed generators. This module turns that output into exactly what `extraction.extract_features`
writes (the same ShardWriter shards and manifest, the same keys and dtypes), so training cannot tell them apart.

speculators (vLLM's `extract_hidden_states` method with its hidden-states connector), one file per sample:
    <dir>/hidden_states/hs_<i>.safetensors  (or <dir>/hs_<i>.safetensors)
        token_ids      [T]
        hidden_states  [T, 4, H]  the three aux layers, then layer id N, in layer order. vLLM's id i is the input of
                                  decoder layer i = HF index i; id N is the last layer's output BEFORE the final norm
                                  (speculators applies the target's norm when it trains), so the norm is applied here.
    The loss mask stays in speculators' Arrow dataset: it comes from our prepared sample with the same tokens.
SpecForge (scripts/prepare_hidden_states.py, SGLang backend), one torch.save'd dict per sample:
    <dir>/rows_<a>-<b>/data_<i>.ckpt
        input_ids [T], loss_mask [T], hidden_state [1, T, H] (after the final norm),
        aux_hidden_state [1, T, 3H] (SGLang's id i = output of layer i = HF index i+1; concatenated low to high)
    Read with torch.load(weights_only=True) only: a file that needs unpickling code is refused. Its rows may be
    right-padded to the longest of their batch (pad positions have loss_mask 0): trimmed back to the prepared sample.

Every file must hold one of our prepared samples (matched by token ids): that gives its id and its train/eval split.
Neither format records which layers it captured; they are taken to be target.aux_layers (written into the manifest
in the source's own convention), while the hidden size and the number of layer slots are checked per file.
"""
from __future__ import annotations

import hashlib
import json
import math
import pickle
import re
import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from eagle3ops.data.hidden_states import encode, finite_positions
from eagle3ops.data.prepare import SPLITS, read_tokenized
from eagle3ops.data.shards import ShardWriter
from eagle3ops.errors import InputError
from eagle3ops.extraction.hf import ExtractResult, NonFiniteError
from eagle3ops.formats.conventions import from_hf
from eagle3ops.fs import write_json_atomic
from eagle3ops.modeling.target import TargetError, TargetLayout, weight_locations
from eagle3ops.progress import progress


class PeerFormatError(InputError):
    """A peer generator's output that cannot be imported as configured."""


def checkpoint_size(path: str | Path) -> dict[str, int]:
    """Parameter count and weight bytes from the safetensors headers, like model_size() of a loaded target:
    the projection scales by them, and this backend never loads the target."""
    path = Path(path)
    params = size = 0
    for name in sorted(set(weight_locations(path).values())):
        with (path / name).open("rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        for key, entry in header.items():
            if key != "__metadata__":
                params += math.prod(entry["shape"])
                size += entry["data_offsets"][1] - entry["data_offsets"][0]
    return {"target_params": params, "target_bytes": size}


FINAL_NORM = re.compile(r"(?:[\w.]*\.)?(?:model|language_model)\.norm\.weight")


def final_norm_weight(path: Path) -> torch.Tensor:
    """The target's final norm weight [H]: `model.norm.weight`, or a wrapper's `language_model.model.norm.weight`
    (Kimi-K2.5) / `model.language_model.norm.weight`."""
    locations = weight_locations(path)
    names = sorted((n for n in locations if FINAL_NORM.fullmatch(n)), key=len)
    if not names:
        raise TargetError(f"{path}: no '*model.norm.weight' tensor in the checkpoint; the final norm is needed to "
                          f"turn speculators' last-layer states into the final normed states")
    with safe_open(str(path / locations[names[0]]), framework="pt") as handle:
        return handle.get_tensor(names[0])


def from_engine_slots(hidden: torch.Tensor, layout: TargetLayout, norm: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's captured slots [T, 4, H] (the aux layers low to high, then the last layer's output) -> aux [T, 3H] in
    the configured layer order, and the final normed state [T, H] float32 (the Llama / DeepSeek-V3 / Kimi final norm,
    weight * x / rms(x))."""
    final = F.rms_norm(hidden[:, -1].float(), (layout.hidden_size,), norm.float(), layout.rms_norm_eps)
    return hidden[:, layout.slot_order].flatten(1), final


def _numbered(paths: Iterator[Path], pattern: re.Pattern) -> list[Path]:
    """The files whose names fit `pattern`, ordered by the sample index it captures."""
    found = [(int(match.group(1)), path) for path in paths if (match := pattern.fullmatch(path.name))]
    return [path for _, path in sorted(found)]


class SpeculatorsFiles:
    """speculators / vLLM `hs_<i>.safetensors` files (see the module docstring)."""
    name, convention = "speculators", "vllm"
    SLOTS = 4  # three aux layers + the last layer

    def __init__(self, directory: Path, layout: TargetLayout):
        self.directory, self.layout = directory, layout
        nested = directory / "hidden_states"  # speculators' FileTransfer keeps them under the dataset dir
        self.files = _numbered((nested if nested.is_dir() else directory).glob("hs_*.safetensors"),
                               re.compile(r"hs_(\d+)\.safetensors"))
        # vLLM ids: id i is the input of decoder layer i (HF index i); id N comes after the last layer
        self.layer_ids = [*from_hf(sorted(layout.aux_layers), self.convention), layout.num_layers]
        self._norm: torch.Tensor | None = None

    @staticmethod
    def _open(path: Path):
        try:
            return safe_open(str(path), framework="pt")
        except Exception as err:  # safetensors raises its own error types for truncated or foreign files
            raise PeerFormatError(f"{path}: not a readable safetensors file ({err})") from None

    def peek(self, path: Path) -> tuple[list[int], list[int] | None]:
        """Token ids (and no loss mask), with every shape checked, without reading the hidden states."""
        with self._open(path) as handle:
            missing = {"token_ids", "hidden_states"} - set(handle.keys())
            if missing:
                raise PeerFormatError(f"{path}: no {sorted(missing)}; a speculators hidden-states file holds "
                                      f"token_ids [T] and hidden_states [T, {self.SLOTS}, H]")
            shape = handle.get_slice("hidden_states").get_shape()
            ids = handle.get_tensor("token_ids")
        hidden = self.layout.hidden_size
        if len(shape) != 3:
            raise PeerFormatError(f"{path}: hidden_states is {shape}, expected [T, {self.SLOTS}, H]")
        if shape[2] != hidden:
            raise PeerFormatError(f"{path}: hidden states of size {shape[2]}, the target's hidden size is {hidden} "
                                  f"({self.layout.path}/config.json): extracted from another model?")
        if shape[1] != self.SLOTS:
            raise PeerFormatError(f"{path}: {shape[1]} hidden-state slots per token, expected {self.SLOTS}: the three "
                                  f"aux layers and the last layer (vLLM layer ids {self.layer_ids}; speculators' "
                                  f"launch_vllm.py --target-layer-ids with --include-last-layer)")
        if ids.dim() != 1 or ids.shape[0] != shape[0]:
            raise PeerFormatError(f"{path}: token_ids is {list(ids.shape)} for {shape[0]} positions of hidden states")
        return ids.tolist(), None

    def states(self, path: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token ids [T], aux [T, 3H] in the configured layer order, final normed state [T, H] float32)."""
        if self._norm is None:
            self._norm = final_norm_weight(self.layout.path)
        with self._open(path) as handle:
            ids, hidden = handle.get_tensor("token_ids"), handle.get_tensor("hidden_states")  # [T], [T, 4, H]
        return ids, *from_engine_slots(hidden, self.layout, self._norm)


class SpecForgeFiles:
    """SpecForge `data_<i>.ckpt` files (see the module docstring)."""
    name, convention = "specforge", "sglang"
    KEYS = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")

    def __init__(self, directory: Path, layout: TargetLayout):
        self.directory, self.layout = directory, layout
        self.files = _numbered(directory.rglob("data_*.ckpt"), re.compile(r"data_(\d+)\.ckpt"))
        # SGLang ids: id i is the output of decoder layer i = HF index i + 1 (--aux-hidden-states-layers)
        self.layer_ids = from_hf(sorted(layout.aux_layers), self.convention)

    @staticmethod
    def _load(path: Path) -> dict:
        """torch.load with weights_only: plain tensors and containers, never code; mmap: nothing read until used."""
        try:
            data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as err:
            found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
            culprit = found.group(1) if found else "not plain tensors"
            raise PeerFormatError(f"{path}: refused: loading it would run unpickling code ({culprit}); only files "
                                  f"that torch.load(weights_only=True) reads are imported: re-save it as a dict of "
                                  f"tensors") from None
        except Exception as err:
            raise PeerFormatError(f"{path}: not a readable torch.save file ({type(err).__name__}: {err})") from None
        if not isinstance(data, dict):
            raise PeerFormatError(f"{path}: holds a {type(data).__name__}, a SpecForge hidden-states file is a dict "
                                  f"with {list(SpecForgeFiles.KEYS)}")
        missing = [key for key in SpecForgeFiles.KEYS if data.get(key) is None]
        if missing:
            raise PeerFormatError(f"{path}: no {missing}" + (" (generated without --enable-aux-hidden-states?)"
                                                             if missing == ["aux_hidden_state"] else ""))
        return data

    @staticmethod
    def _rows(path: Path, data: dict, key: str, dims: int) -> torch.Tensor:
        """The tensor without SpecForge's batch dimension of 1: [T] for dims 1, [T, X] for dims 2."""
        tensor = data[key]
        if not isinstance(tensor, torch.Tensor):
            raise PeerFormatError(f"{path}: {key} is a {type(tensor).__name__}, not a tensor")
        if tensor.dim() == dims + 1 and tensor.shape[0] == 1:
            tensor = tensor[0]
        if tensor.dim() != dims:
            raise PeerFormatError(f"{path}: {key} is {list(tensor.shape)}, expected "
                                  f"{'[1, T] or [T]' if dims == 1 else '[1, T, X] or [T, X]'}")
        return tensor

    def _checked(self, path: Path) -> tuple[dict, int]:
        data = self._load(path)
        hidden = self.layout.hidden_size
        final, aux = self._rows(path, data, "hidden_state", 2), self._rows(path, data, "aux_hidden_state", 2)
        if final.shape[1] != hidden:
            raise PeerFormatError(f"{path}: hidden_state of size {final.shape[1]}, the target's hidden size is "
                                  f"{hidden} ({self.layout.path}/config.json): extracted from another model?")
        if aux.shape[1] != 3 * hidden:
            raise PeerFormatError(f"{path}: aux_hidden_state is {aux.shape[1]} wide = {aux.shape[1] / hidden:g} "
                                  f"layers of the target's hidden size {hidden}; EAGLE-3 needs 3 (SGLang layer ids "
                                  f"{self.layer_ids})")
        length = self._rows(path, data, "input_ids", 1).shape[0]
        for key, tensor in (("loss_mask", self._rows(path, data, "loss_mask", 1)), ("hidden_state", final),
                            ("aux_hidden_state", aux)):
            if tensor.shape[0] != length:
                raise PeerFormatError(f"{path}: {key} has {tensor.shape[0]} positions, input_ids {length}")
        return data, length

    def peek(self, path: Path) -> tuple[list[int], list[int] | None]:
        data, _ = self._checked(path)
        return (self._rows(path, data, "input_ids", 1).tolist(),
                [int(bool(m)) for m in self._rows(path, data, "loss_mask", 1).tolist()])

    def states(self, path: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token ids [T], aux [T, 3H] in the configured layer order, final normed state [T, H])."""
        data, length = self._checked(path)
        aux = self._rows(path, data, "aux_hidden_state", 2).view(length, 3, -1)  # [T, 3, H], low to high
        return (self._rows(path, data, "input_ids", 1), aux[:, self.layout.slot_order].flatten(1),
                self._rows(path, data, "hidden_state", 2))


READERS = {reader.name: reader for reader in (SpeculatorsFiles, SpecForgeFiles)}  # config.IMPORT_FORMATS


def open_source(directory: str | Path, fmt: str | None, layout: TargetLayout) -> SpeculatorsFiles | SpecForgeFiles:
    """The peer output in `directory` (extract.import_dir), in format `fmt` or the one its file names show."""
    directory = Path(directory)
    if not directory.is_dir():
        raise PeerFormatError(f"extract.import_dir: {directory} is not a directory")
    if fmt is None:
        found = {name: reader(directory, layout) for name, reader in READERS.items()}
        present = [name for name, source in found.items() if source.files]
        if len(present) != 1:
            raise PeerFormatError(
                f"{directory}: " + ("holds both speculators and SpecForge files" if present else
                                    "no hs_<i>.safetensors (speculators) nor data_<i>.ckpt (SpecForge) files")
                + "; set extract.import_format, or point extract.import_dir at the generator's output")
        return found[present[0]]
    source = READERS[fmt](directory, layout)
    if not source.files:
        expected = "hs_<i>.safetensors (or hidden_states/hs_<i>...)" if fmt == "speculators" else "data_<i>.ckpt"
        raise PeerFormatError(f"{directory}: no {expected} files (extract.import_format={fmt})")
    return source


def _token_key(ids: list[int]) -> bytes:
    return hashlib.blake2b(array("q", ids).tobytes(), digest_size=16).digest()


class PreparedIndex:
    """Our prepared samples by their token ids: which sample (id, split, loss mask) a peer file holds."""

    def __init__(self, prepared: Path):
        self.prepared = prepared
        self.ids: dict[str, list[str]] = {}  # per split
        self._by_key: dict[bytes, list[tuple[str, dict]]] = {}
        for split in SPLITS:
            samples = read_tokenized(prepared / split)
            self.ids[split] = [sample["id"] for sample in samples]
            for sample in samples:
                self._by_key.setdefault(_token_key(sample["input_ids"]), []).append((split, sample))
        self._lengths = sorted({len(s["input_ids"]) for group in self._by_key.values() for _, s in group}, reverse=True)
        self.taken: dict[str, Path] = {}  # sample id -> the file that holds it

    def take(self, path: Path, ids: list[int], loss_mask: list[int] | None) -> tuple[str, dict]:
        """(split, prepared sample) of the file: the same tokens, or, where a loss mask shows trailing padding
        (loss_mask 0 after the sample's end), the sample those padded tokens start with."""
        lengths = [len(ids)]
        if loss_mask is not None:
            last = max((i for i, m in enumerate(loss_mask) if m), default=-1)
            lengths += [n for n in self._lengths if last < n < len(ids)]
        earlier = None
        for n in lengths:
            for split, sample in self._by_key.get(_token_key(ids[:n]), ()):
                if sample["input_ids"] != ids[:n]:
                    continue
                if sample["id"] not in self.taken:
                    self.taken[sample["id"]] = path
                    return split, sample
                earlier = earlier or self.taken[sample["id"]]
        if earlier is not None:
            raise PeerFormatError(f"{path}: holds the same tokens as {earlier}; each prepared sample is imported once")
        raise PeerFormatError(f"{path}: its {len(ids)} token ids match no prepared sample in {self.prepared} (train or "
                              f"eval): the generator ran on other data, or on another tokenization (tokenizer, chat "
                              f"template, data.max_len); hand it {self.prepared}'s token ids")


@dataclass
class Planned:
    path: Path
    sample_id: str
    length: int  # the prepared sample's: a padded row is cut back to it
    loss_mask: torch.Tensor  # [length] uint8


@dataclass
class SplitPlan:
    items: list[Planned] = field(default_factory=list)
    prepared: int = 0  # samples of this split in the prepared data
    missing: list[str] = field(default_factory=list)  # their ids that no peer file holds


@dataclass
class ImportPlan:
    splits: dict[str, SplitPlan]
    loss_mask_differs: int  # SpecForge files whose own loss mask is not the prepared one (theirs is kept)

    @property
    def missing(self) -> int:
        return sum(len(plan.missing) for plan in self.splits.values())


def plan_import(source: SpeculatorsFiles | SpecForgeFiles, prepared: str | Path,
                max_nonfinite_fraction: float) -> ImportPlan:
    """Check every file's shapes and find its prepared sample, reading token ids only, before anything is written:
    a wrong file fails here, naming itself. Prepared samples no file holds count like non-finite ones (SpecForge
    skips those it finds NaN): above extract.max_nonfinite_fraction the import stops."""
    index = PreparedIndex(Path(prepared))
    splits = {split: SplitPlan(prepared=len(index.ids[split])) for split in SPLITS}
    differs = 0
    with progress(len(source.files), f"import scan ({source.name})", "file") as bar:
        for path in source.files:
            ids, loss_mask = source.peek(path)
            split, sample = index.take(path, ids, loss_mask)
            length = len(sample["input_ids"])
            if loss_mask is not None:
                loss_mask = loss_mask[:length]
                differs += loss_mask != sample["loss_mask"]
            mask = torch.tensor(loss_mask if loss_mask is not None else sample["loss_mask"], dtype=torch.uint8)
            splits[split].items.append(Planned(path, sample["id"], length, mask))
            bar.update(1)
    for split, plan in splits.items():
        plan.missing = [sample_id for sample_id in index.ids[split] if sample_id not in index.taken]
        if len(plan.missing) > int(max_nonfinite_fraction * plan.prepared):
            raise PeerFormatError(
                f"{source.directory}: {len(plan.missing)} of {plan.prepared} prepared {split} samples have no "
                f"hidden states in extract.import_dir (first: {plan.missing[:5]}), more than "
                f"extract.max_nonfinite_fraction={max_nonfinite_fraction}: is the generator finished, and did it run "
                f"on {prepared}'s samples?")
    if differs:
        print(f"import: {differs} {source.name} files carry a loss mask other than the prepared one; theirs is kept",
              flush=True)
    return ImportPlan(splits, differs)


@torch.no_grad()
def import_features(source: SpeculatorsFiles | SpecForgeFiles, plan: SplitPlan, out_dir: str | Path,
                    samples_per_shard: int, dtype: str = "float32", meta: dict | None = None, desc: str = "import",
                    resumable: bool = False, max_nonfinite_fraction: float = 0.01) -> ExtractResult:
    """Write one split's planned samples as extract_features would: input_ids int32, loss_mask uint8, aux_hidden
    [T, 3H] and final_hidden [T, H] in `dtype` (data/hidden_states.py), in ShardWriter shards with the same
    manifest fields. Samples with NaN/inf states are skipped and counted. With `resumable`, a rerun continues after
    the last complete shard; the ids skipped for NaN/inf are kept beside the partial directory so the rerun starts
    at the same file."""
    out_dir = Path(out_dir)
    layout = source.layout
    writer = ShardWriter(out_dir, samples_per_shard, resumable=resumable,
                         meta={**(meta or {}), "aux_layers": layout.aux_layers, "hidden_size": layout.hidden_size,
                               "dtype": dtype})
    skipped_file = out_dir.with_name(f".{out_dir.name}.nonfinite.json")
    nonfinite = json.loads(skipped_file.read_text()) if writer.samples_done and skipped_file.is_file() else []
    start = _resume_position(plan.items, writer.samples_done, set(nonfinite))
    before = {item.sample_id for item in plan.items[:start]}
    nonfinite = [sample_id for sample_id in nonfinite if sample_id in before]
    if start:
        print(f"{desc}: resuming after {writer.samples_done} of {len(plan.items)} samples (complete shards kept)",
              flush=True)
    allowed = int(max_nonfinite_fraction * plan.prepared)
    began, tokens = time.perf_counter(), 0
    try:
        with progress(len(plan.items), desc, "sample", initial=start) as bar:
            for item in plan.items[start:]:
                ids, aux, final = source.states(item.path)
                states = {**encode("aux_hidden", aux[: item.length], 3, dtype),
                          **encode("final_hidden", final[: item.length], 1, dtype)}
                tokens += item.length
                bar.update(1)
                if not finite_positions(states).all():
                    nonfinite.append(item.sample_id)  # poison for training: skip and count
                    if len(nonfinite) + len(plan.missing) > allowed:
                        raise NonFiniteError(
                            f"{len(nonfinite)} of {plan.prepared} samples have NaN/inf hidden states (first: "
                            f"{nonfinite[:5]}: {item.path}), {len(plan.missing)} more are missing: more than "
                            f"extract.max_nonfinite_fraction={max_nonfinite_fraction}")
                    if resumable:
                        write_json_atomic(skipped_file, nonfinite)
                    continue
                writer.add(item.sample_id, {
                    "input_ids": ids[: item.length].to(torch.int32), "loss_mask": item.loss_mask,
                    **{name: tensor.contiguous() for name, tensor in states.items()}})
        manifest = writer.close()
        skipped_file.unlink(missing_ok=True)
    except BaseException:
        if not resumable:
            writer.abort()
        raise
    return ExtractResult(manifest["samples"], tokens, time.perf_counter() - began, manifest, nonfinite)


def _resume_position(items: list[Planned], written: int, skipped: set[str]) -> int:
    """Index of the first planned item after the `written` samples of the complete shards (and the ones skipped
    among them)."""
    position = count = 0
    while count < written and position < len(items):
        count += items[position].sample_id not in skipped
        position += 1
    return position
