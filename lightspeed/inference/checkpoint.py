"""Inference checkpoints: read a model's weights from checkpoint files one tensor at a time, and write
a prepared (cast, quantized) model back so that it loads without re-quantizing.

Owns: the streaming load (the files found and read by `checkpoint_files.py`, the keys matched to the
model's by `checkpoint_keys.py`) and the save. Must not decide which layers are quantized (engine.py
passes that in).

Note: [the streaming load] Each tensor is read from the files (safetensors maps the file; torch files
are opened with mmap), moved to the device, cast, and for a layer to quantize quantized there, before
the next is read: neither the host nor the device ever holds the whole model in float. Parameters
shared by several modules (a tied lm_head) get one tensor, loaded from whichever of their names the
checkpoint holds. A model built on the meta device (`lightspeed.OnDevice`) gets every parameter from
the checkpoint; a tensor still on meta afterwards is an error naming it.

Note: [the saved form] `save_inference_checkpoint` writes the model's state dict as sharded
safetensors (`model-00001-of-0000N.safetensors`, Hugging Face's names), the index
`model.safetensors.index.json`, a Hugging Face model's config.json / generation_config.json, and
DeepSpeed's `ds_inference_config.json` last (each file atomically;
the JSON names every shard, so a crash mid-save never leaves a JSON naming a missing file). Quantized
layers are stored packed, with their format and group size in every shard's metadata
(`lightspeed.quant`) and the packed-layout version in each layer's buffers.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping

import torch
from torch import nn

from lightspeed._utils.logging import get_logger
from lightspeed._utils.progress import progress
from lightspeed.checkpoint.atomic import atomic_write_bytes, atomic_write_via
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.inference.checkpoint_files import (DS_CONFIG_NAME, INDEX_NAMES, QUANT_METADATA_KEY, TP_RANKS_KEY,
                                                  CheckpointReader)
from lightspeed.inference.checkpoint_keys import key_mapping, transformers_conversions
from lightspeed.inference.experts import QuantizedExperts, experts_layout
from lightspeed.inference.quantized_linear import QuantizedLinear, is_conv1d, linear_dims, linear_from_float
from lightspeed.inference.tensor_parallel import Slice, expert_indices

logger = get_logger(__name__)

DEFAULT_SHARD_BYTES = 2 * 2**30


# ---------------------------------------------------------------------------------------------- load

class _Loader:
    def __init__(self, model: nn.Module, reader: CheckpointReader, device: torch.device, dtype: torch.dtype):
        self.reader, self.device, self.dtype = reader, device, dtype
        expected = list(model.state_dict(keep_vars=True))
        self.renamed, self.per_expert = transformers_conversions(model, reader.keys())
        prefixed = key_mapping(expected, [*reader.keys(), *self.renamed], getattr(model, "base_model_prefix", "") or "")
        self.ckpt_key = lambda key: self.renamed.get(prefixed(key), prefixed(key))
        self.used: set[str] = set()

    def read(self, key: str, like: torch.Tensor | None = None, shape=None, index=None) -> torch.Tensor | None:
        """The checkpoint's tensor for model key `key` on the device in the dtype (None when absent), its
        shape checked against `shape` or `like`'s; `index`: only that part of it is read."""
        ckey = self.ckpt_key(key)
        if ckey not in self.reader:
            return None
        expected = shape if shape is not None else like.shape if like is not None else None
        if expected is not None and self.reader.shape(ckey) != tuple(expected):
            raise CheckpointError(f"checkpoint tensor {ckey!r} has shape {self.reader.shape(ckey)}, the model's is "
                                  f"{tuple(expected)}")
        tensor = self.reader.get(ckey, index)
        self.used.add(ckey)
        floating = tensor.is_floating_point() and (like is None or like.is_floating_point())
        dtype = self.dtype if floating else (like.dtype if like is not None else tensor.dtype)
        tensor = tensor.to(device=self.device).to(dtype=dtype)
        if tensor.device.type == "cpu" and tensor.data_ptr() % 64:
            # safetensors' CPU tensors may start off the 64 bytes torch's allocator aligns to; CPU BLAS then
            # runs other code paths: slower, and other rounding than the same weights made in memory
            tensor = tensor.clone()
        return tensor

    def saved_format(self, name: str) -> tuple[str, int | None] | None:
        if self.ckpt_key(name + ".qweight") not in self.reader:
            return None
        saved = self.reader.quant.get(self.ckpt_key(name + ".qweight")[:-len(".qweight")])
        if saved is None:
            raise CheckpointError(f"checkpoint holds the packed layer {name!r} but no {QUANT_METADATA_KEY} metadata "
                                  "saying its format")
        return saved

    def packed_layer(self, name: str, module: nn.Module | tuple[int, int], fmt: str,
                     group_size: int | None) -> QuantizedLinear:
        """A QuantizedLinear from the packed buffers the checkpoint holds (no re-quantization); `module` the
        layer it replaces, or its (out_features, in_features)."""
        out_features, in_features = module if isinstance(module, tuple) else linear_dims(module)
        bias_key = self.ckpt_key(name + ".bias")
        layer = QuantizedLinear(in_features, out_features, bias=bias_key in self.reader, weight=fmt,
                                group_size=group_size, dtype=self.dtype, device=self.device)
        state = {}
        for buffer_name, buffer in layer.state_dict().items():
            tensor = self.read(f"{name}.{buffer_name}", like=buffer)
            if tensor is None:
                raise CheckpointError(f"checkpoint lacks {self.ckpt_key(f'{name}.{buffer_name}')!r} of the packed "
                                      f"layer {name!r}")
            state[buffer_name] = tensor
        layer.load_state_dict(state)  # checks the packed-layout version
        return layer

    def packed_experts(self, name: str, module: nn.Module, wanted: tuple[str, int | None] | None) -> nn.Module | None:
        """QuantizedExperts from the packed per-expert layers the checkpoint holds for the experts module
        `name` (saved by `save_mp_checkpoint_path`), None when it holds none."""
        layout = experts_layout(module)
        saved = self.saved_format(f"{name}.gate_up.0") if isinstance(layout, tuple) else None
        if saved is None:
            return None
        if wanted is not None and tuple(wanted) != tuple(saved):
            raise ValueError(f"init_inference: the experts {name!r} are saved as {saved[0]} (group_size={saved[1]}) "
                             f"but {wanted[0]} (group_size={wanted[1]}) is asked for; load them from the float "
                             f"weights to quantize them again")
        experts, hidden, inter = layout
        gate_up = [self.packed_layer(f"{name}.gate_up.{e}", (2 * inter, hidden), *saved) for e in range(experts)]
        down = [self.packed_layer(f"{name}.down.{e}", (hidden, inter), *saved) for e in range(experts)]
        return QuantizedExperts(gate_up, down, module.act_fn)

    def _expert_sources(self, key: str) -> tuple[list[dict[int, str]] | None, str | None]:
        """Where the model's 3-D experts parameter `key` is in the checkpoint: (per source (gate, up, ...)
        {expert: key}, None) when it keeps one matrix per expert, (None, its key) when it holds the 3-D
        tensor, (None, None) when neither."""
        sources = self.per_expert.get(self.ckpt_key(key))
        if sources is not None:
            return sources, None
        return None, self.ckpt_key(key) if self.ckpt_key(key) in self.reader else None

    def _expert_matrix(self, key: str, e: int, shape: tuple[int, int], part: Slice | None) -> torch.Tensor:
        """Expert e's matrix of the 3-D experts parameter `key` (whole: [rows, cols] = `shape`), or this rank's
        `part` of it (tensor parallelism: `expert_indices`), each piece read alone, on the device in the
        dtype. Per-expert sources are the whole matrix's row blocks (gate, up), joined along the rows."""
        sources, whole_key = self._expert_sources(key)
        rows, cols = shape
        if whole_key is not None:
            if self.reader.shape(whole_key)[1:] != tuple(shape):
                raise CheckpointError(f"checkpoint tensor {whole_key!r} has shape {self.reader.shape(whole_key)}, the "
                                      f"model's experts are {tuple(shape)} each")
            sources, src_rows = [{e: whole_key}], rows
        else:
            src_rows = rows // len(sources)
        if part is not None:
            indices = expert_indices("down" if key.endswith("down_proj") else "gate_up", rows, cols, part.rank,
                                     part.size)
        else:
            indices = [(slice(i * src_rows, (i + 1) * src_rows), slice(None)) for i in range(len(sources))]
        pieces = []
        for row_slice, col_slice in indices:  # each within one source: a part's rows lie in one half
            i = row_slice.start // src_rows
            if e not in sources[i]:
                raise CheckpointError(f"checkpoint lacks expert {e} of {key!r} (it has experts {sorted(sources[i])})")
            ckey = sources[i][e]
            local = slice(row_slice.start - i * src_rows, row_slice.stop - i * src_rows)
            if whole_key is not None:
                piece = self.reader.get(ckey, (slice(e, e + 1), local, col_slice))[0]
            else:
                if self.reader.shape(ckey) != (src_rows, cols):
                    raise CheckpointError(f"checkpoint tensor {ckey!r} has shape {self.reader.shape(ckey)}, the "
                                          f"model's is {(src_rows, cols)}")
                piece = self.reader.get(ckey, (local, col_slice))
            self.used.add(ckey)
            pieces.append(piece.to(device=self.device, dtype=self.dtype))
        return pieces[0].contiguous() if len(pieces) == 1 else torch.cat(pieces)

    def float_experts(self, name: str, module: nn.Module, wanted: tuple[str, int | None] | None,
                      part: Slice | None = None) -> nn.Module | None:
        """The experts module `name` from the float weights the checkpoint holds, one matrix per expert
        (transformers' original format, `checkpoint_keys.transformers_conversions`) or 3-D, each expert
        matrix read alone (this rank's `part` of it under tensor parallelism): QuantizedExperts quantized to
        `wanted` as they are read, or with `wanted` None the module itself with its 3-D parameters
        filled. None when the checkpoint holds neither form."""
        experts, hidden, inter = experts_layout(module)
        shapes = {"gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}
        missing = [p for p in shapes if self._expert_sources(f"{name}.{p}") == (None, None)]
        if len(missing) == len(shapes):
            return None
        if missing:
            raise CheckpointError(f"checkpoint holds {name}'s experts without {missing[0]}")
        layers = {}
        for param, shape in shapes.items():
            matrix = functools.partial(self._expert_matrix, f"{name}.{param}", shape=shape, part=part)
            if wanted is None:
                stacked = torch.stack([matrix(e) for e in range(experts)])
                setattr(module, param, nn.Parameter(stacked, requires_grad=False))
            else:  # one expert matrix in float at a time
                layers[param] = [QuantizedLinear.from_float(matrix(e), None, *wanted) for e in range(experts)]
        return module if wanted is None else QuantizedExperts(layers["gate_up_proj"], layers["down_proj"], module.act_fn)

    def float_layer(self, name: str, module: nn.Module, wanted: tuple[str, int | None] | None,
                    part: Slice | None) -> nn.Module | None:
        """The layer from the float weight the checkpoint holds: only this rank's `part` of it if given
        (tensor parallelism: only those bytes are read), then quantized to `wanted` (format, group_size),
        or else an nn.Linear. None when the checkpoint holds no weight for it."""
        out_features, in_features = linear_dims(module)
        conv1d = is_conv1d(module)
        shape = (in_features, out_features) if conv1d else (out_features, in_features)
        if part is None:
            weight = self.read(f"{name}.weight", shape=shape)
        else:  # each index of the part read alone (a fused q|k|v layer has three), joined along the outputs
            pieces = [self.read(f"{name}.weight", shape=shape, index=(cols, rows) if conv1d else (rows, cols))
                      for rows, cols in part.indices((out_features, in_features))]  # Conv1D stores [in, out]
            weight = None if pieces[0] is None else torch.cat(pieces, dim=1 if conv1d else 0)
        if weight is None:
            return None
        bias = getattr(module, "bias", None)
        if bias is not None:
            loaded = self.read(f"{name}.bias", like=bias)
            if loaded is None and bias.is_meta:
                raise CheckpointError(f"checkpoint lacks {self.ckpt_key(name + '.bias')!r}")
            bias = loaded if loaded is not None else bias.detach().to(device=self.device, dtype=self.dtype)
            bias = part.bias(bias) if part is not None else bias
        return build_linear(weight.t() if conv1d else weight, bias, wanted)


def build_linear(weight: torch.Tensor, bias: torch.Tensor | None, wanted: tuple[str, int | None] | None,
                 part: Slice | None = None) -> nn.Module:
    """`linear_from_float` of this rank's `part` of a float weight [N, K] (tensor parallelism) if given,
    else of all of it."""
    if part is not None:
        weight, bias = part.weight(weight), part.bias(bias)
    return linear_from_float(weight, bias, wanted)


def replace_submodule(model: nn.Module, name: str, layer: nn.Module) -> None:
    """Put `layer` where the submodule `name` of `model` is."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)


def load_checkpoint(model: nn.Module, files: list[str], *, quantize: Mapping[str, tuple[str, int | None]],
                    device: torch.device, dtype: torch.dtype, shards: Mapping[str, Slice] | None = None,
                    quantize_experts: tuple[str, int | None] | None = None,
                    experts_chosen=lambda name: True) -> list[str]:
    """Fill `model` (built on the meta device or real) from checkpoint `files` in place, one tensor at a
    time, on `device` in `dtype` (floating-point tensors). Layers named in `quantize` ({name: (format,
    group_size)}) become QuantizedLinear, from the packed form when the checkpoint holds one, else
    quantized on the device from the float weight. Layers named in `shards` ({name: Slice}, tensor
    parallelism) keep only this rank's part, read alone and quantized after the cut. MoE experts
    modules the checkpoint holds packed become QuantizedExperts as saved (`quantize_experts`: the
    (format, group_size) asked for, which they must match); held as one matrix per expert (the
    original format transformers converts at load: Mixtral's `block_sparse_moe.experts.N.w1`,
    Qwen-MoE's `mlp.experts.N.gate_proj`, ...), those `experts_chosen(name)` accepts become QuantizedExperts
    quantized to `quantize_experts` one expert matrix at a time, the others get their 3-D parameters;
    3-D float ones load as parameters. Returns the names of the quantized layers and experts modules."""
    reader = CheckpointReader(files)
    loader = _Loader(model, reader, device, dtype)
    shards = shards or {}
    quantized, built = [], set()
    bar = _LoadProgress(model, dtype, bool(quantize) or quantize_experts is not None)
    for name, module in bar.walk(model, list(model.named_modules())):
        if experts_layout(module) is not None:  # MoE experts saved packed: loaded as saved
            layer = loader.packed_experts(name, module, quantize_experts)
            part = shards.get(name)
            if layer is not None and part is not None:
                raise ValueError(f"init_inference: the experts {name!r} are saved packed, which cannot be split for "
                                 "tensor parallelism; load the float checkpoint")
            if layer is None and isinstance(experts_layout(module), tuple):  # float: per expert, or 3-D
                wanted = quantize_experts if quantize_experts is not None and experts_chosen(name) else None
                layer = loader.float_experts(name, module, wanted, part)
            if layer is module:  # its own 3-D float parameters, filled
                built.add(id(module))
            elif layer is not None:
                replace_submodule(model, name, layer)
                built.update(id(m) for m in layer.modules())
                quantized.append(name)
            continue
        if not (isinstance(module, (nn.Linear, QuantizedLinear)) or is_conv1d(module)):
            continue
        saved = loader.saved_format(name)
        wanted = quantize.get(name)
        part = shards.get(name)
        if isinstance(module, QuantizedLinear):
            wanted = (module.weight_format, module.group_size)
        if saved is not None:
            if part is not None:
                raise ValueError(f"init_inference: layer {name!r} is saved packed ({saved[0]}), which cannot be split "
                                 "for tensor parallelism; load the float checkpoint")
            if wanted is not None and tuple(wanted) != tuple(saved):
                raise ValueError(f"init_inference: layer {name!r} is saved as {saved[0]} (group_size={saved[1]}) "
                                 f"but {wanted[0]} (group_size={wanted[1]}) is asked for; load it from the float "
                                 f"weights to quantize it again")
            layer = loader.packed_layer(name, module, *saved)
        elif wanted is not None or part is not None:
            layer = loader.float_layer(name, module, wanted, part)
            if layer is None:
                if isinstance(module, QuantizedLinear) or module.weight.is_meta:
                    raise CheckpointError(f"checkpoint lacks {loader.ckpt_key(name + '.weight')!r}")
                logger.warning("init_inference: %s is not in the checkpoint; using the weights the model has", name)
                weight = module.weight.detach().to(device=device, dtype=dtype)
                bias = None if module.bias is None else module.bias.detach().to(device=device, dtype=dtype)
                layer = build_linear(weight.t() if is_conv1d(module) else weight, bias, wanted, part)
        else:
            continue
        replace_submodule(model, name, layer)
        built.add(id(layer))
        if isinstance(layer, QuantizedLinear):
            quantized.append(name)
    _load_remaining(model, loader, built, bar)
    bar.close()
    unused = [k for k in reader.keys() if k not in loader.used]
    if unused:
        logger.info("init_inference: %d checkpoint tensors the model does not use, e.g. %s", len(unused),
                    ", ".join(unused[:3]))
    return quantized


class _LoadProgress:
    """The bar of `load_checkpoint`: bytes of the model's parameters and persistent buffers in the
    loaded dtype (a shared tensor once), advanced as each module's own tensors are filled."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, quantizing: bool):
        itemsize = torch.empty((), dtype=dtype).element_size()
        persistent = [b for m in model.modules() for n, b in m._buffers.items()
                      if b is not None and n not in m._non_persistent_buffers_set]  # in no checkpoint otherwise
        self.sizes = {id(t): t.numel() * (itemsize if t.is_floating_point() else t.element_size())
                      for t in [*model.parameters(), *persistent]}
        self.counted: set[int] = set()
        what = "loading and quantizing" if quantizing else "loading"
        self.bar = progress(total=sum(self.sizes.values()), desc=f"{what} the checkpoint", unit="B",
                            unit_scale=True, unit_divisor=1024)

    def walk(self, model: nn.Module, named_modules):
        """Yield `named_modules`; once the caller is done with one, its own tensors count as loaded if it
        was replaced or its tensors were (the others are loaded later, by `_load_remaining`)."""
        for name, module in named_modules:
            own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]  # before any replacement
            yield name, module
            now = {id(t) for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]}
            if not _still_there(model, name, module) or any(id(t) not in now for t in own):
                self.tensors_done(own)

    def tensors_done(self, tensors) -> None:
        for t in tensors:
            if id(t) in self.sizes and id(t) not in self.counted:
                self.counted.add(id(t))
                self.bar.update(self.sizes[id(t)])

    def close(self) -> None:
        self.bar.close()


def _still_there(model: nn.Module, name: str, module: nn.Module) -> bool:
    try:
        return model.get_submodule(name) is module
    except AttributeError:  # a parent was replaced
        return False


def _load_remaining(model: nn.Module, loader: _Loader, built: set[int], bar: _LoadProgress) -> None:
    """Every other parameter and persistent buffer (not those of the layers in `built`, ids of the
    modules made from the checkpoint already); shared tensors once, under any of their names."""
    slots: dict[int, list[tuple[nn.Module, str, str, bool]]] = {}
    for mname, module in model.named_modules():
        if id(module) in built:
            continue
        for pname, p in module._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((module, pname, f"{mname}.{pname}" if mname else pname, True))
        for bname, b in module._buffers.items():
            if b is not None and bname not in module._non_persistent_buffers_set:
                slots.setdefault(id(b), []).append((module, bname, f"{mname}.{bname}" if mname else bname, False))
    missing = []
    for group in slots.values():
        module, attr, _, is_param = group[0]
        old = (module._parameters if is_param else module._buffers)[attr]
        tensor = None
        for _, _, full, _ in group:
            tensor = loader.read(full, like=old)
            if tensor is not None:
                break
        if tensor is None:
            if old.is_meta:
                missing.append(loader.ckpt_key(group[0][2]))
            continue
        new = nn.Parameter(tensor, requires_grad=old.requires_grad) if is_param else tensor
        for owner, name, _, _ in group:
            (owner._parameters if is_param else owner._buffers)[name] = new
        bar.tensors_done([old])
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensor(s) the model built on the meta device needs: "
                              f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    still_meta = [f"{m}.{n}" if m else n for m, module in model.named_modules()
                  for n, t in [*module._parameters.items(), *module._buffers.items()] if t is not None and t.is_meta]
    if still_meta:
        raise CheckpointError(f"{', '.join(still_meta[:5])} stayed on the meta device: a non-persistent buffer is in no "
                              "checkpoint; build the model under lightspeed.OnDevice('meta'), which keeps buffers real")


# ---------------------------------------------------------------------------------------------- save

def _unique_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with each shared tensor once (safetensors refuses aliases), first name kept."""
    seen, out = set(), {}
    for key, tensor in model.state_dict().items():
        ident = (tensor.device, tensor.untyped_storage().data_ptr() if tensor.numel() else id(tensor),
                 tensor.storage_offset(), tuple(tensor.shape), tensor.dtype)
        if ident not in seen:
            seen.add(ident)
            out[key] = tensor
    return out


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor that is all of its storage: a view (an expert's slice of QuantizedExperts'
    stacked buffers) is copied, as safetensors refuses tensors that share memory."""
    tensor = tensor.contiguous()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def save_inference_checkpoint(model: nn.Module, directory: str | os.PathLike,
                              max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[str]:
    """Write `model` as it is (cast, quantized) to `directory`: sharded safetensors, the index and
    DeepSpeed's `ds_inference_config.json` (see the Note of this module). Host memory holds one shard
    at a time. Returns the shard file names. `init_inference(model_on_meta, checkpoint=directory)`
    loads it back without re-quantizing."""
    from safetensors.torch import save_file

    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    state = _unique_state(model)
    quant = {name: {"weight": m.weight_format, "group_size": m.group_size}
             for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    shards: list[list[str]] = [[]]
    size = 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    metadata = {"format": "pt", QUANT_METADATA_KEY: json.dumps(quant)}
    for name, keys in zip(names, shards):
        cpu = {key: _own_storage(state[key].detach().to("cpu")) for key in keys}
        atomic_write_via(os.path.join(directory, name), lambda tmp: save_file(cpu, tmp, metadata=metadata))
        del cpu
    weight_map = {key: name for name, keys in zip(names, shards) for key in keys}
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    atomic_write_bytes(os.path.join(directory, INDEX_NAMES[0]), json.dumps(index, indent=2).encode())
    _write_model_config(model, directory)
    ds_config = {"type": "ds_model", "checkpoints": names, "version": 1.0, "dtype": _dtype_name(state),
                 "lightspeed_quant": quant}
    atomic_write_bytes(os.path.join(directory, DS_CONFIG_NAME), json.dumps(ds_config, indent=2).encode())
    logger.info("init_inference: saved %.1f MiB in %d file(s) to %s", total / 2**20, len(names), directory)
    return names


def _write_model_config(model: nn.Module, directory: str) -> None:
    """A Hugging Face model's config.json (and generation_config.json) beside its weights, so the saved
    directory is a model directory (`AutoConfig.from_pretrained` works on it)."""
    for attr, name in (("config", "config.json"), ("generation_config", "generation_config.json")):
        to_json = getattr(getattr(model, attr, None), "to_json_string", None)
        if callable(to_json):
            atomic_write_bytes(os.path.join(directory, name), to_json().encode())


def _dtype_name(state: Mapping[str, torch.Tensor]) -> str:
    dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
    return str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else "mixed"


def rank_dir(rank: int) -> str:
    return f"tp_{rank:02d}"


def write_split_config(directory: str | os.PathLike, rank_names: list[list[str]], model: nn.Module) -> None:
    """The top-level `ds_inference_config.json` of a checkpoint saved under tensor parallelism: each
    rank's files (under `tp_<rank>/`), written once every rank's files are in place."""
    ds_config = {"type": "ds_model", "version": 1.0, "parallelization": "tp", "tp_size": len(rank_names),
                 "checkpoints": {TP_RANKS_KEY: [[f"{rank_dir(r)}/{n}" for n in names]
                                                for r, names in enumerate(rank_names)]},
                 "dtype": _dtype_name(model.state_dict())}
    _write_model_config(model, os.fspath(directory))
    atomic_write_bytes(os.path.join(os.fspath(directory), DS_CONFIG_NAME), json.dumps(ds_config, indent=2).encode())
