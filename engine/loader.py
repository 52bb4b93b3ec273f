"""safetensors -> model parameters (single file or sharded with an index), or dummy weights."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from engine import int4
from engine.models.llama import LlamaForCausalLM
from engine.parallel.layers import Shard
from engine.quant import FP8_GROUP, INT4_PACK, UNUSED_SUFFIXES, Int4Format, quantize_weight
from kernels import reference

FP8 = torch.float8_e4m3fn
INT4 = torch.int32  # a 4-bit weight's dtype: eight values a word (engine/int4.py)
# a 4-bit checkpoint's tensors the loop over a file does not read: the group index of each input
# column (GPTQ's g_idx, compressed-tensors' weight_g_idx; read beside the packed values where the
# checkpoint's groups are in activation order, _act_order), compressed-tensors' weight shape
INT4_UNUSED_SUFFIXES = (".g_idx", "_g_idx", ".weight_shape")


class WeightLoadError(ValueError):
    pass


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / f for f in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors weights in {folder} (use --load-format dummy for random weights)")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise WeightLoadError(f"{folder}: the index names missing files {missing}")
    return files


@torch.no_grad()
def load_weights(model: LlamaForCausalLM, folder: Path, show_progress: bool = True) -> None:
    """Each tensor of the checkpoint into its parameter; a sharded parameter (tensor parallel)
    reads only this rank's slice of it, and another pipeline stage's tensors are not read at all."""
    params = dict(model.named_parameters())
    buffers = quant_buffers(model)
    params.update(buffers)
    shards = model.param_shards()
    quant = model.quant
    perms: set[str] = set()  # act-order weights whose column order one segment has set
    _identity_orders(buffers, shards)
    if isinstance(quant, Int4Format) and not quant.tensor_names()[2]:  # symmetric: zero points of 8
        for name, b in buffers.items():
            if name.endswith("weight_zero"):
                b.fill_(8)
    wmap = model.hf_weight_map()
    emap = model.hf_expert_map()  # None: another rank's expert
    eshards = model.expert_shards()
    expected = len(wmap) + sum(v is not None for v in emap.values())
    loaded: dict[str, int] = {}
    files = safetensors_files(folder)
    chosen = _rows_in_down_order(files, wmap, params, shards, quant)
    headless = model.global_cfg.headless  # a base model's tensors: named without "model."
    bar = tqdm(total=expected, desc="loading weights", unit="tensor", disable=not show_progress, file=sys.stderr)
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                key = "model." + name if headless and not name.startswith("model.") else name
                if key in emap:
                    if emap[key] is not None:
                        ours, e, seg = emap[key]
                        _load_one(f, name, params[ours][e], (eshards[ours].inner, seg))
                        loaded[key] = 1
                        bar.update(1)
                    continue
                if key not in wmap:
                    if quant is not None and name.endswith(UNUSED_SUFFIXES + INT4_UNUSED_SUFFIXES):
                        continue
                    if isinstance(quant, Int4Format) and name.endswith("proj.bias") and not f.get_tensor(name).any():
                        continue  # GPTQ's zero biases of layers without one
                    if model.held_elsewhere(key):
                        continue
                    if name == "lm_head.weight" and model.global_cfg.tie_word_embeddings:
                        continue  # tied: some checkpoints still store the copy
                    if "rotary_emb" in name:
                        continue
                    raise WeightLoadError(f"{path.name}: unexpected tensor {name!r} for {model.cfg.architecture}")
                ours, seg = wmap[key]
                if isinstance(quant, Int4Format) and ours.endswith(("proj.weight", "_scale", "_zero")):
                    weight = ours.rsplit(".", 1)[0] + ".weight"
                    columns = (_act_order(f, name, params, weight, perms, quant, shards[weight])
                               if quant.act_order and ours == weight else None)
                    _load_int4(f, name, params[ours], shards[weight], seg, quant, columns, chosen.get(weight))
                elif ours.endswith("weight_scale"):
                    weight = ours[:-len("_scale")]
                    _load_scale(f, name, params[ours], params[weight], shards[weight], seg, quant.blocked)
                else:
                    _load_one(f, name, params[ours], None if seg is None else (shards[ours], seg),
                              params.get(ours + "_scale"))
                loaded[key] = 1
                bar.update(1)
    bar.close()
    missing = [n for n in (*wmap, *(k for k, v in emap.items() if v is not None)) if n not in loaded]
    if missing:
        raise WeightLoadError(f"{folder}: missing weights, e.g. {missing[:3]} ({len(missing)} in all)")
    _zero_padding(model, shards)


def _identity_orders(buffers: dict[str, torch.Tensor], shards: dict[str, Shard]) -> None:
    """Act-order weights' column orders (weight_perm: storage only after engine/runner.py's
    materialize) as the identity, for dummy weights; a checkpoint's g_idx replaces them. A weight as
    wide as the whole one on a rank that holds a part of its input (_weight) takes its part first,
    zeros after it."""
    for name, b in buffers.items():
        if name.endswith("weight_perm"):
            shard = shards.get(name[:-len("_perm")])
            width = shard.local_size if shard is not None and shard.dim == 1 else len(b)
            ids = torch.arange(len(b), device=b.device)
            b.copy_(torch.where(ids < width, ids, -1))


def quant_buffers(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Our quantized weights' scale, zero-point and column-order buffers by name ("...proj.weight_scale",
    "...proj.weight_zero", "...proj.weight_perm"), {} for a 16-bit model."""
    return {n: b for n, b in model.named_buffers() if n.endswith(("weight_scale", "weight_zero", "weight_perm"))}


def _group_index(f, gname: str, cols: int, groups: int) -> torch.Tensor:
    """A projection's group of each of its `cols` input columns (GPTQ's g_idx, compressed-tensors'
    weight_g_idx), checked to hold cols / groups columns a group."""
    g_idx = f.get_tensor(gname).to(torch.int64)
    if g_idx.shape != (cols,) or g_idx.min() < 0 or g_idx.max() >= groups or \
            not torch.equal(torch.bincount(g_idx, minlength=groups), torch.full((groups,), cols // groups)):
        raise WeightLoadError(f"{gname}: not {groups} groups of {cols // groups} input columns each")
    return g_idx


def _group_index_name(name: str, fmt: Int4Format) -> str:
    return name[:-len(fmt.tensor_names()[0])] + fmt.group_index_name


def _act_order(f, name: str, params: dict[str, torch.Tensor], weight: str, perms: set[str], fmt: Int4Format,
               shard: Shard) -> torch.Tensor:
    """Activation order (GPTQ's desc_act, compressed-tensors' actorder "group"): the checkpoint's
    input column of each of our weight's columns (-1: a column of zeros), by the projection's group
    index (read from the same file), and the weight's weight_perm (x's column of each).
    - The whole input (q/k/v, gate/up; one rank): the columns sorted by group. Every projection
      packed into one weight has the same input and must have the same order.
    - Split over ranks, by group (the MLP's down): sorted by group and then cut; no weight_perm (the
      rank's gate/up rows make h in that order: _rows_in_down_order).
    - Split over ranks, every group (o): group g's columns of this rank's input first, then zeros,
      group after group."""
    gname = _group_index_name(name, fmt)
    if gname not in f.keys():
        raise WeightLoadError(f"{name}: a weight in activation order without {gname} in the same file")
    cols = shard.global_size if shard.dim == 1 else params[weight].shape[1] * INT4_PACK
    group = cols if fmt.group == -1 else fmt.group
    g_idx = _group_index(f, gname, cols, cols // group)
    order = torch.argsort(g_idx, stable=True)
    dst = params.get(weight + "_perm")
    if dst is None:
        return order
    if shard.dim == 1 and shard.local_size != shard.global_size:
        seg = shard.segments[0]
        mine = torch.arange(seg.start, seg.start + seg.length)
        by_group = torch.argsort(g_idx[mine], stable=True)
        g = g_idx[mine][by_group]
        first = torch.cumsum(torch.bincount(g, minlength=cols // group), 0) - torch.bincount(g, minlength=cols // group)
        columns = torch.full((cols,), -1, dtype=torch.int64)
        columns[g * group + torch.arange(len(g)) - first[g]] = mine[by_group]
        dst.copy_(torch.where(columns >= 0, columns - seg.start, -1).to(dst.device))
        return columns
    if weight not in perms:
        dst.copy_(order.to(dst.device))
        perms.add(weight)
    elif not torch.equal(dst, order.to(dst.device)):
        raise WeightLoadError(f"{gname}: its act-order differs from the other projections packed with it (the same "
                              "input must have one column order); a checkpoint quantized with its groups in "
                              "column order loads")
    return order


def _rows_in_down_order(files: list[Path], wmap: dict, params: dict[str, torch.Tensor], shards: dict[str, Shard],
                        quant) -> dict[str, torch.Tensor]:
    """Where the MLP's down projection is in activation order and split over ranks: the gate/up
    rows (of gate's and of up's) each rank holds, its share of down's input columns in down's group
    order, so that h comes out in the order of the rank's down columns. {gate_up weight: rows}."""
    if not (isinstance(quant, Int4Format) and quant.act_order):
        return {}
    wanted: dict[str, tuple[str, Shard]] = {}  # down's group index in the checkpoint -> (our gate/up, down's shard)
    for name, (ours, _) in wmap.items():
        shard = shards.get(ours)
        if ours.endswith("mlp.down_proj.weight") and name.endswith(quant.tensor_names()[0]) and \
                ours + "_perm" not in params and shard is not None and shard.local_size != shard.global_size:
            wanted[_group_index_name(name, quant)] = (ours.replace("down_proj", "gate_up_proj"), shard)
    rows: dict[str, torch.Tensor] = {}
    for path in files if wanted else []:
        with safe_open(str(path), framework="pt") as f:
            for gname in wanted.keys() & set(f.keys()):
                gate_up, shard = wanted[gname]
                cols = shard.global_size
                group = cols if quant.group == -1 else quant.group
                seg = shard.segments[0]
                order = torch.argsort(_group_index(f, gname, cols, cols // group), stable=True)
                rows[gate_up] = order[seg.start:seg.start + seg.length]
    missing = [g for g in wanted if wanted[g][0] not in rows]
    if missing:
        raise WeightLoadError(f"a down projection in activation order without its group index {missing[0]}")
    return rows


def _load_int4(f, name: str, dst: torch.Tensor, shard: Shard, i: int, fmt: Int4Format,
               columns: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> None:
    """One tensor of a 4-bit checkpoint (packed values, scales or zero points of one projection)
    into segment i's part of our weight, weight_scale or weight_zero (engine/int4.py's layout):
    turned into column order, cut, and packed or transposed. columns: the packed values' input
    column of each of our weight's columns (activation order; -1: zeros), taken before packing.
    rows: the rows this rank holds of each segment, where not its contiguous part (_rows_in_down_order)."""
    kind = 0 if dst.dtype == INT4 else 1 if dst.dtype == torch.float16 else 2
    src = int4.to_engine(fmt, kind, f.get_tensor(name).to(dst.device))  # [N, K] values, or [N, K/G]
    if columns is not None:
        src = reference.gather_columns(src, columns.to(src.device))
    seg = shard.segments[i]
    out = dst if kind == 0 else dst.t()  # [N, ...] as src
    width = out.shape[1] * (INT4_PACK if kind == 0 else 1)
    if shard.dim == 0:
        picked = src[seg.start:seg.start + seg.length] if rows is None else src.index_select(0, rows.to(src.device))
        part, out = picked, out.narrow(0, shard.local_offset(i), seg.length)
    elif width == src.shape[1]:  # the whole input: one rank, one group a row, or every group (_act_order)
        part = src
    else:
        per = seg.global_size // src.shape[1]  # input columns a value (1) or a group holds
        if seg.global_size % src.shape[1] or seg.start % per or seg.length % per:
            raise WeightLoadError(f"{name}: this rank's input columns ({seg.length} of {seg.global_size} from "
                                  f"{seg.start}) do not align with the checkpoint's 4-bit groups; use fewer ranks")
        part = src[:, seg.start // per:(seg.start + seg.length) // per]
    if kind == 0:
        part = int4.pack(part)
    if tuple(part.shape) != tuple(out.shape):
        raise WeightLoadError(f"{name}: shape {tuple(part.shape)} in the engine's layout does not match the "
                              f"config's {tuple(out.shape)} (a {fmt.method} checkpoint with groups of {fmt.group})")
    out.copy_(part)


def _scale_view(scale: torch.Tensor, shard: Shard, i: int, rows_per_scale: int, name: str) -> torch.Tensor:
    """The part of a weight's scales that segment i of its shard owns: its rows' (one scale or
    row of block scales per weight row) or its 128-row blocks' along the output dimension; all of
    them where the shard cuts the input dimension."""
    seg, off = shard.segments[i], shard.local_offset(i)
    if shard.dim == 1:
        if rows_per_scale > 1 and seg.start % FP8_GROUP:
            raise WeightLoadError(f"{name}: this rank's part ({seg.length} of {seg.global_size} from {seg.start}) "
                                  f"does not align with the checkpoint's {FP8_GROUP} x {FP8_GROUP} FP8 blocks; "
                                  "use fewer ranks")
        return scale
    if rows_per_scale == 1:
        return scale.narrow(0, off, seg.length)
    return scale.narrow(0, off // FP8_GROUP, -(-seg.length // FP8_GROUP))  # blocks_align() held


def _load_scale(f, name: str, scale: torch.Tensor, weight: torch.Tensor, shard: Shard, i: int, blocked: bool) -> None:
    """A checkpoint's FP8 scale tensor (one per tensor, per channel or per block) into segment i's
    part of our scale buffer."""
    src = f.get_tensor(name).float()
    seg = shard.segments[i]
    per_row = scale.shape[0] == weight.shape[0]
    dst = _scale_view(scale, shard, i, 1 if per_row else FP8_GROUP, name)
    if src.numel() == 1:
        dst.fill_(src.item())
        return
    a, n = seg.start // FP8_GROUP, -(-seg.length // FP8_GROUP)  # the segment's blocks
    if not blocked:
        src = src.reshape(-1, 1)
        part = src[seg.start:seg.start + seg.length] if shard.dim == 0 else src
    elif shard.dim == 0:
        part = src.repeat_interleave(FP8_GROUP, 0)[seg.start:seg.start + seg.length] if per_row else src[a:a + n]
    else:
        part = src[:, a:a + n]
    if tuple(part.shape) != tuple(dst.shape):
        raise WeightLoadError(f"{name}: FP8 scales of shape {tuple(src.shape)} do not fit the weight "
                              f"({'128 x 128 blocks' if blocked else 'one per tensor or output channel'} expected)")
    dst.copy_(part)


def _quantize_into(dst: torch.Tensor, src: torch.Tensor, scale: torch.Tensor | None, name: str) -> None:
    """A 16/32-bit src into the FP8 dst, quantized per channel, its scales into scale [len(dst), 1]."""
    if scale is None or scale.shape != (dst.shape[0], 1):
        raise WeightLoadError(f"{name}: a 16-bit tensor where the checkpoint's FP8 weights have block scales")
    q, s = quantize_weight(src.to(dst.device), blocked=False)
    dst.copy_(q)
    scale.copy_(s)


def _load_one(f, name: str, param: torch.Tensor, part: tuple[Shard, int] | None,
              scale: torch.Tensor | None = None) -> None:
    """Tensor `name` of the open file f into param, or into segment part[1] of a sharded param; into
    an FP8 param a 16-bit tensor goes quantized per channel, its scales into scale."""
    if part is None:
        src = f.get_tensor(name)
        if tuple(src.shape) != tuple(param.shape):
            raise WeightLoadError(f"{name}: shape {tuple(src.shape)} does not match the config's {tuple(param.shape)}")
        param.copy_(src)
        return
    shard, i = part
    seg = shard.segments[i]
    whole = f.get_slice(name)
    want = list(param.shape)
    want[shard.dim] = seg.global_size
    if list(whole.get_shape()) != want:
        raise WeightLoadError(f"{name}: shape {tuple(whole.get_shape())} does not match the config's {tuple(want)}")
    cut = slice(seg.start, seg.start + seg.length)
    src = whole[cut] if shard.dim == 0 else whole[:, cut]
    dst = param.narrow(shard.dim, shard.local_offset(i), seg.length)
    if dst.dtype == FP8 and src.dtype != FP8:
        per_row = scale is not None and scale.shape[1] == 1
        _quantize_into(dst, src, _scale_view(scale, shard, i, 1, name) if per_row else None, name)
    else:
        dst.copy_(src)


def _zero_padding(model: LlamaForCausalLM, shards: dict[str, Shard]) -> None:
    """Rows beyond a shard's segments (the last rank's vocabulary padding) hold zeros."""
    for name, p in model.named_parameters():
        shard = shards.get(name)
        if shard is not None and shard.local_size < p.shape[shard.dim]:
            p.narrow(shard.dim, shard.local_size, p.shape[shard.dim] - shard.local_size).zero_()


@torch.no_grad()
def init_dummy_weights(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Random weights with the real shapes (benchmarks: throughput doesn't depend on values).
    Small uniform values keep activations finite in bf16; norms stay 1. A sharded parameter is
    drawn whole and cut: every rank holds its part of the same model, whatever the rank count."""
    if model.stage.size > 1:
        return _init_dummy_stage(model, seed)
    g = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(seed)
    shards = model.param_shards()
    eshards = model.expert_shards()
    buffers = quant_buffers(model)
    _identity_orders(buffers, shards)
    for name, p in model.named_parameters():
        shard = shards.get(name)
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name in eshards:
            _dummy_experts(p, eshards[name], g)
        elif model.quant is None and (shard is None or shard.local_size == shard.global_size == p.shape[shard.dim]):
            p.uniform_(-0.02, 0.02, generator=g)
        else:  # drawn whole and cut; a quantized weight drawn in the model's dtype and quantized
            dtype = model.embed_tokens.weight.dtype
            full = torch.empty(_draw_shape(p, shard), dtype=dtype, device=p.device).uniform_(-0.02, 0.02, generator=g)
            _take_dummy(p, shard, full, name, buffers, model.quant)
            del full
    _zero_padding(model, shards)


def _draw_shape(p: torch.Tensor, shard: Shard | None) -> list[int]:
    """The whole 16-bit tensor a dummy parameter is cut from (a 4-bit weight's eight values a word)."""
    shape = list(p.shape)
    if p.dtype == INT4:
        shape[1] *= INT4_PACK
    if shard is not None:
        shape[shard.dim] = shard.global_size
    return shape


def _take_dummy(p: torch.Tensor, shard: Shard | None, full: torch.Tensor, name: str,
                buffers: dict[str, torch.Tensor], quant) -> None:
    """p from its rank's part of the dummy draw `full`, quantized where p is (its scales and zero
    points into buffers[name + "_scale"], ["_zero"])."""
    local = shard.take(full) if shard is not None else full
    if p.dtype == FP8:
        scale = buffers[name + "_scale"]
        q, s = quantize_weight(local, quant.blocked)
        p.copy_(q)
        scale.copy_(s.repeat_interleave(FP8_GROUP, 0)[:len(p)] if quant.blocked and len(scale) == len(p) else s)
    elif p.dtype == INT4:
        width = p.shape[1] * INT4_PACK
        if local.shape[1] < width:  # as wide as the whole weight (_weight): this rank's columns, then zeros
            local = torch.cat([local, local.new_zeros(local.shape[0], width - local.shape[1])], dim=1)
        q, s, z = int4.quantize(local, -1 if quant.group == -1 else quant.group)
        p.copy_(q)
        buffers[name + "_scale"].copy_(s)
        buffers[name + "_zero"].copy_(z)
    elif shard is not None:
        p.narrow(shard.dim, 0, shard.local_size).copy_(local)
    else:
        p.copy_(local)


def _dummy_experts(p: torch.Tensor, shard, g: torch.Generator) -> None:
    """A stacked expert parameter drawn whole (all experts, full width) and cut, expert by expert
    (a whole draw of Mixtral-8x7B's w13 would take 2 GiB at once)."""
    one = shard.global_shape(p.shape)[1:]
    for e in range(shard.experts.global_size):
        full = torch.empty(one, dtype=p.dtype, device=p.device).uniform_(-0.02, 0.02, generator=g)
        local = e - shard.experts.start
        if 0 <= local < p.shape[0]:
            p[local].copy_(shard.inner.take(full))


@torch.no_grad()
def _init_dummy_stage(model: LlamaForCausalLM, seed: int) -> None:
    """init_dummy_weights for one pipeline stage: the whole model's parameters are drawn in the
    whole model's order (from a copy of it on the meta device), those of other stages thrown away,
    so the stages together hold the model that one GPU would (a tied LM head takes the embedding's)."""
    some = next(p for p in model.parameters() if p.is_floating_point() and p.dtype != FP8)
    device, dtype = some.device, some.dtype
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        whole = LlamaForCausalLM(model.global_cfg, model.comm, expert_parallel=model.expert_parallel, quant=model.quant)
    ours = dict(model.named_parameters())
    buffers = quant_buffers(model)
    shards, whole_shards = model.param_shards(), whole.param_shards()
    _identity_orders(buffers, shards)
    eshards = whole.expert_shards()
    start = model.stage.start
    for name, meta_p in whole.named_parameters():
        local = name
        if name.startswith("layers."):
            i = int(name.split(".")[1])
            local = f"layers.{i - start}.{name.split('.', 2)[2]}" if model.stage.owns_layer(i) else None
        elif name == "embed_tokens.weight" and model.embed_tokens is None and model.lm_head is not None \
                and model.global_cfg.tie_word_embeddings:
            local = "lm_head.weight"
        p = ours.get(local) if local is not None else None
        if name.endswith("norm.weight"):
            if p is not None:
                p.fill_(1.0)
            continue
        if name in eshards:
            _dummy_experts(p if p is not None else torch.empty_like(meta_p, device=device, dtype=dtype),
                           eshards[name], g)
            continue
        shard = whole_shards.get(name) if p is None else shards.get(local)
        full = torch.empty(_draw_shape(meta_p, shard), dtype=dtype, device=device)
        full.uniform_(-0.02, 0.02, generator=g)
        if p is not None:
            _take_dummy(p, shard, full, local, buffers, model.quant)
        del full
    _zero_padding(model, shards)
