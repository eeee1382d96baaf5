"""Build a model from a checkpoint folder, a .gguf file or a hub id, and load its weights.

The model is built directly on the target device in the target dtype (no fp32
copy on the CPU first), for one tensor-parallel rank: its layers hold only their
shards. Checkpoint tensors map onto parameters by name; a parameter that fuses
several checkpoint tensors (`MergedColumnParallelLinear`, stacked experts) is filled
part by part, and a sharded one takes its rows, through its `weight_loader`. Every name is
checked before any tensor is read, so a mismatched checkpoint fails fast, naming
what is missing and what is unexpected. A GGUF file's tensors, dequantized under
their Hugging Face names (extkv.models.gguf), go through the same matching.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm
from transformers import PretrainedConfig

from extkv.distributed import SINGLE, TPGroup, use_group
from extkv.models.bamba import BambaForCausalLM
from extkv.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from extkv.models.gemma3 import Gemma3ForCausalLM
from extkv.models.gemma3_mm import Gemma3ForConditionalGeneration
from extkv.models.gguf import gguf_tensors
from extkv.models.hf_config import ModelSource, resolve_model
from extkv.models.layers import default_weight_loader
from extkv.models.llama import LlamaForCausalLM, MistralForCausalLM
from extkv.models.llava import LlavaForConditionalGeneration
from extkv.models.mamba2_model import Mamba2ForCausalLM
from extkv.models.parallel import MergedColumnParallelLinear
from extkv.models.qwen3 import Qwen2ForCausalLM, Qwen3ForCausalLM
from extkv.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "BambaForCausalLM": BambaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "Mamba2ForCausalLM": Mamba2ForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}
# For configs without `architectures` (GGUF files, some hand-written configs).
_BY_MODEL_TYPE = {
    "bamba": "BambaForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "llava": "LlavaForConditionalGeneration",
    "mamba2": "Mamba2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

# Tensors older checkpoints carry that the model recomputes itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_LISTED_NAMES = 20


def model_class(config: PretrainedConfig) -> type[nn.Module]:
    """The class of the config's first architecture, else of its `model_type`; an error
    lists the supported ones."""
    architectures = getattr(config, "architectures", None) or []
    model_type = getattr(config, "model_type", None)
    name = architectures[0] if architectures else _BY_MODEL_TYPE.get(model_type)
    if name not in MODEL_REGISTRY:
        found = repr(name) if architectures else f"None (model_type {model_type!r})"
        raise ValueError(
            f"unsupported architecture {found}; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        )
    return MODEL_REGISTRY[name]


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _build(
    config: PretrainedConfig, dtype: torch.dtype, device: torch.device, group: TPGroup
) -> nn.Module:
    with torch.device(device), _default_dtype(dtype), use_group(group):
        return model_class(config)(config)


def load_model(
    path: str | os.PathLike | ModelSource,
    dtype: torch.dtype,
    device: torch.device | str,
    group: TPGroup = SINGLE,
) -> tuple[nn.Module, PretrainedConfig]:
    """The model `path` names (a checkpoint folder, a .gguf file or a hub id) on `device` in
    `dtype` (this rank's shard of it), weights loaded, in eval mode, and its config."""
    source = path if isinstance(path, ModelSource) else resolve_model(path)
    config = source.config()
    device = torch.device(device)
    model = _build(config, dtype, device, group)
    _fill(model, source, config, dtype, device, show=group.rank == 0)  # one bar, not one per rank
    return model.requires_grad_(False).eval(), config


def reload_weights(
    model: nn.Module, path: str | os.PathLike, dtype: torch.dtype, device: torch.device
) -> None:
    """Fill the parameters of a model `load_model` built from `path` again, in place (their
    memory was given back, e.g. by sleep level 2)."""
    source = resolve_model(path)
    _fill(model, source, source.config(), dtype, device, show=False)


def _fill(
    model: nn.Module,
    source: ModelSource,
    config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    show: bool,
) -> None:
    if source.gguf_file is None:
        load_weights(model, source.path, device, show)
    else:
        file = os.path.join(source.path, source.gguf_file)
        load_tensors(model, gguf_tensors(file, config, dtype), file, device, show)


def check_tensor_parallel(path: str | os.PathLike, size: int) -> None:
    """Raise the ValueError that splitting the model `size` ways would, before any worker
    process starts: build it on the meta device, which allocates nothing."""
    config = resolve_model(path).config()
    _build(config, torch.float32, torch.device("meta"), TPGroup(0, size))


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint: those of the shard index, else all of them."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, shard) for shard in shards]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


@dataclass
class _Slot:
    """One parameter, or one part of a merged one, and the checkpoint names that may fill it
    (several when weights are tied: lm_head.weight and model.embed_tokens.weight)."""

    param: nn.Parameter
    part: str | None
    names: list[str] = field(default_factory=list)


def _join(*names: str) -> str:
    return ".".join(n for n in names if n)


def _sources(module_name: str, module: nn.Module, param_name: str) -> list[tuple[str, str | None]]:
    """(checkpoint name, part) of every tensor that fills parameter `param_name` of
    `module`: the sibling modules' a merged linear fuses, the per-expert tensors stacked
    experts hold (their `checkpoint_parts`), else the parameter's own name."""
    if isinstance(module, MergedColumnParallelLinear):
        parent = module_name.rpartition(".")[0]
        return [(_join(parent, part, param_name), part) for part in module.parts]
    whole = [(_join(module_name, param_name), None)]
    parts = getattr(module, "checkpoint_parts", None)
    if parts is not None:  # or whole, as transformers 5 keeps them (its state_dict())
        return [(_join(module_name, part), part) for part in parts(param_name)] + whole
    return whole


def _slots(model: nn.Module) -> list[_Slot]:
    """Every parameter (part) of `model` with the checkpoint names that may fill it."""
    slots: dict[tuple[int, str | None], _Slot] = {}
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            sources = _sources(module_name, module, param_name)
            for name, part in sources:
                slots.setdefault((id(param), part), _Slot(param, part)).names.append(name)
    return list(slots.values())


def _listing(names: list[str]) -> str:
    names = sorted(names)
    more = f" and {len(names) - _LISTED_NAMES} more" if len(names) > _LISTED_NAMES else ""
    return ", ".join(names[:_LISTED_NAMES]) + more


def _renamer(model: nn.Module):  # -> Callable[[str], str]
    """Checkpoint name -> parameter name: the model's `checkpoint_name` where it has one
    (a layout its checkpoints spell several ways), else the name itself."""
    return getattr(model, "checkpoint_name", None) or (lambda name: name)


def _missing(unfilled: list[_Slot], chosen: Iterable[_Slot]) -> list[str]:
    """The names to report missing: a parameter is complete with its whole tensor, or
    with all its parts; one of which nothing came is missing whole where it can come so
    (stacked experts), else part by part (a merged linear's)."""
    whole_given, some_given = set(), set()
    for slot in chosen:
        some_given.add(id(slot.param))
        if slot.part is None:
            whole_given.add(id(slot.param))
    can_be_whole = {id(slot.param) for slot in unfilled if slot.part is None}
    missing = []
    for slot in unfilled:
        key = id(slot.param)
        if key in whole_given:
            continue
        if key in some_given:  # some parts came: the others are missing
            if slot.part is not None:
                missing.append(slot.names[0])
        elif slot.part is None or key not in can_be_whole:
            missing.append(slot.names[0])
    return missing


def _match(
    model: nn.Module, available: set[str], source: str, complete: bool = True
) -> dict[str, _Slot]:
    """The slot each name of `available` (checkpoint names as `_renamer` maps them) fills;
    a ValueError names every unexpected tensor and, when the tensors must be `complete`,
    every missing one. `source` says whose names they are ("checkpoint PATH")."""
    chosen: dict[str, _Slot] = {}
    unfilled: list[_Slot] = []
    known: set[str] = set()
    for slot in _slots(model):
        known.update(slot.names)
        present = [name for name in slot.names if name in available]
        if present:
            chosen[present[0]] = slot  # tied: the first module's name wins, as in HF
        else:
            unfilled.append(slot)
    missing = _missing(unfilled, chosen.values()) if complete else []
    # Stacked experts come whole or per expert, never both: which would win is arbitrary.
    whole = {id(slot.param): name for name, slot in chosen.items() if slot.part is None}
    twice = sorted({whole[id(s.param)] for s in chosen.values() if s.part and id(s.param) in whole})
    ignores = getattr(model, "ignores_tensor", None)  # a model's own extra tensors
    unexpected = [
        n
        for n in available - known
        if not n.endswith(_IGNORED_SUFFIXES) and not (ignores and ignores(n))
    ]
    if missing or unexpected or twice:
        problems = [f"missing tensors: {_listing(missing)}"] if missing else []
        problems += [f"unexpected tensors: {_listing(unexpected)}"] if unexpected else []
        problems += [f"given both whole and in parts: {_listing(twice)}"] if twice else []
        raise ValueError(f"{source} does not match {type(model).__name__}: " + "; ".join(problems))
    return chosen


def _progress(total: int, show: bool) -> tqdm:
    """A bar over the tensors to load: on the CPU a big checkpoint takes a while."""
    return tqdm(total=total, desc="Loading weights", unit="tensor", disable=not show)


def _fill_slot(
    slot: _Slot, tensor: torch.Tensor, what: str, into: nn.Parameter | None = None
) -> None:
    """Load `tensor` (`what`, for errors) through the slot's weight loader, into its
    parameter or the stand-in `into` (a dry run on the meta device)."""
    weight_loader = getattr(slot.param, "weight_loader", default_weight_loader)
    try:
        weight_loader(slot.param if into is None else into, tensor, slot.part)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


@torch.no_grad()
def load_weights(
    model: nn.Module, path: str, device: torch.device, show_progress: bool = True
) -> None:
    """Fill every parameter of `model` from the safetensors of `path`, casting to its dtype."""
    rename = _renamer(model)
    names_in: dict[str, list[str]] = {}
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            names_in[file] = list(f.keys())
    chosen = _match(
        model, {rename(n) for names in names_in.values() for n in names}, f"checkpoint {path}"
    )
    with _progress(len(chosen), show_progress) as bar:
        for file, names in names_in.items():
            with safe_open(file, framework="pt", device=str(device)) as f:
                for name in names:
                    slot = chosen.get(rename(name))
                    if slot is not None:
                        what = f"checkpoint tensor {name} in {file}"
                        _fill_slot(slot, f.get_tensor(name), what)
                        bar.update()


@torch.no_grad()
def load_tensors(
    model: nn.Module,
    tensors: dict[str, torch.Tensor],
    where: str,
    device: torch.device,
    show_progress: bool = True,
) -> None:
    """Fill every parameter of `model` from `tensors` (Hugging Face names, all in memory, as
    a GGUF file's are), releasing each once loaded so that two copies never coexist."""
    rename = _renamer(model)
    chosen = _match(model, set(map(rename, tensors)), f"checkpoint {where}")
    with _progress(len(chosen), show_progress) as bar:
        for name in list(tensors):
            tensor = tensors.pop(name)
            slot = chosen.get(rename(name))
            if slot is not None:
                what = f"checkpoint tensor {name} in {where}"
                _fill_slot(slot, tensor.to(device), what)
                bar.update()


# Whose names `check_weights` matches, for its errors.
_GIVEN = "the weights given to load_weights (checkpoint names, as transformers' state_dict() has)"


@torch.no_grad()
def check_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], why_all: str | None = None
) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of `weights` that fill parameters of `model`, in their order,
    each checked before any is loaded (a generator is read whole first): its name against
    the model's (with `why_all`, the reason, every parameter must be given), its shape
    through a dry run of its weight loader on the meta device. Names the model ignores, and
    a tied parameter's names after its first, are left out, as they are from a checkpoint.
    Names come back as `_renamer` maps them (the parameters' own spelling)."""
    rename = _renamer(model)
    given: dict[str, torch.Tensor] = {}
    for item in weights:
        if not (
            isinstance(item, tuple | list)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], torch.Tensor)
        ):
            raise ValueError(f"weights must be (name, tensor) pairs; got {item!r:.80}")
        name, tensor = rename(item[0]), item[1]
        if name in given:
            raise ValueError(f"load_weights: {name} is given twice")
        if not tensor.is_floating_point():
            raise ValueError(
                f"load_weights: {name} has dtype {tensor.dtype}; a floating-point tensor is "
                "expected (it is cast to the model's dtype)"
            )
        given[name] = tensor
    source = _GIVEN
    if why_all is not None:
        source += f", which must give every parameter ({why_all}),"
    chosen = _match(model, set(given), source, complete=why_all is not None)
    for name, slot in chosen.items():
        stand_in = nn.Parameter(torch.empty_like(slot.param, device="meta"), requires_grad=False)
        _fill_slot(slot, given[name].to("meta"), f"load_weights: {name}", into=stand_in)
    return [(name, tensor) for name, tensor in given.items() if name in chosen]


@torch.no_grad()
def fill_weights(model: nn.Module, names: list[str], tensors: Iterable[torch.Tensor]) -> None:
    """Load `tensors` into the parameters `names` name (pairs `check_weights` passed), one
    at a time, in place: the parameters keep their addresses."""
    chosen = _match(model, set(names), _GIVEN, complete=False)
    for name, tensor in zip(names, tensors, strict=True):
        _fill_slot(chosen[name], tensor, f"load_weights: {name}")
