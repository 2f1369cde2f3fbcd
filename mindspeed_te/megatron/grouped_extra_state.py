"""Per-expert FP8 metadata in Megatron's distributed checkpoints of grouped (MoE) linears.

A GroupedLinear keeps one `_extra_state` for all its local experts. megatron-core 0.16.1's TEGroupedLinear
checkpoints it per expert, so that a checkpoint saved with one expert-parallel layout loads with another:
`_split_extra_state` cuts it into one entry per expert, `_sharded_state_dict_grouped` stores expert i's as
`_extra_state` of that expert's shard (`_extra_state{i}` in the module's sharded state dict), and on load
the entries are merged back (`_extra_state1..n-1` into `_extra_state`) before the module reads them.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from mindspeed_te.distributed import group_rank, group_size
from mindspeed_te.modules.base import decode_extra_state, encode_extra_state

__all__ = ["GroupedExtraStateMixin"]

# metadata key -> (quantizers per GEMM, dim along which the module's quantizers run)
_PER_GEMM = {"fwd_amax_history": (3, 1), "fwd_scale": (3, 0), "bwd_amax_history": (2, 1), "bwd_scale": (2, 0)}


def _ep_group(pg_collection: Optional[object]):
    group = getattr(pg_collection, "ep", None) if pg_collection is not None else None
    if group is None:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            group = parallel_state.get_expert_model_parallel_group()
    return group


def _expert_dp_rank(pg_collection: Optional[object]) -> int:
    group = getattr(pg_collection, "expt_dp", None) if pg_collection is not None else None
    if group is not None:
        return group_rank(group)
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0
    return parallel_state.get_expert_data_parallel_rank()


class GroupedExtraStateMixin:
    """Mixed into TEGroupedLinear (needs `num_gemms`, `use_bias`, `_tp_group`, `_pg_collection`)."""

    def _encode_extra_state(self, state: dict[str, Any]) -> torch.Tensor:
        return encode_extra_state(state)

    def _decode_extra_state(self, state: Any) -> Optional[dict[str, Any]]:
        """The metadata dict, or None for an empty entry (no FP8)."""
        return decode_extra_state(state, type(self).__name__)

    def _split_extra_state(self, state: Any) -> list[Any]:
        """One `_extra_state` per local expert: expert i's quantizers (forward 3i..3i+2, backward 2i, 2i+1).
        Without FP8 metadata every expert gets the entry as it is."""
        meta = self._decode_extra_state(state)
        if meta is None or meta["recipe_key"] is None:
            return [state] * self.num_gemms
        pieces = []
        for i in range(self.num_gemms):
            piece = {"version": meta["version"], "recipe_key": meta["recipe_key"]}
            for key, (per_gemm, dim) in _PER_GEMM.items():
                if key in meta:
                    piece[key] = meta[key].narrow(dim, per_gemm * i, per_gemm).clone()
            pieces.append(self._encode_extra_state(piece))
        return pieces

    def _merge_extra_states(self, state_dict: dict[str, Any], prefix: str) -> None:
        """Fold a dist-checkpoint's per-expert `_extra_state`, `_extra_state1`, ... into one `_extra_state`,
        in place. A torch-native checkpoint (one entry) is left alone."""
        keys = [f"{prefix}_extra_state{i}" for i in range(1, self.num_gemms)]
        if not keys or keys[0] not in state_dict:
            return
        states = [state_dict[f"{prefix}_extra_state"]] + [state_dict.pop(k) for k in keys]
        metas = [self._decode_extra_state(s) for s in states]
        if any(m is None or m["recipe_key"] is None for m in metas):
            return  # saved before (or without) FP8: the first entry says so
        merged = {"version": metas[0]["version"], "recipe_key": metas[0]["recipe_key"]}
        for key, (_, dim) in _PER_GEMM.items():
            if key in metas[0]:
                merged[key] = torch.cat([m[key] for m in metas], dim=dim)
        state_dict[f"{prefix}_extra_state"] = self._encode_extra_state(merged)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self._merge_extra_states(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _sharded_state_dict_grouped(self, tp_axis_map: dict[str, int], prefix: str = "",
                                    sharded_offsets: tuple = (), metadata: Optional[dict] = None) -> dict:
        """Each local expert's weight, bias and `_extra_state` as shards of the global expert stack (expert
        index along a new axis); with `metadata['singleton_local_shards']` each expert instead gets keys of its
        own (`<global expert index>.<prefix>...`) and no expert axis. Replicas are counted over expert data
        parallelism, as in megatron-core."""
        singleton_local_shards = (metadata or {}).get("singleton_local_shards", False)
        dp_cp_group = (metadata or {}).get("dp_cp_group")
        ep_group = _ep_group(self._pg_collection)
        ep_size, ep_rank = (group_size(ep_group), group_rank(ep_group)) if ep_group is not None else (1, 0)
        num_global_experts = ep_size * self.num_gemms
        ep_axis = len(sharded_offsets)
        full = self.state_dict(prefix="", keep_vars=True)
        extra_states = self._split_extra_state(full["_extra_state"])
        result = {}
        for i in range(self.num_gemms):
            global_index = ep_rank * self.num_gemms + i
            local = {f"{i}.weight": full[f"weight{i}"], f"{i}._extra_state": extra_states[i]}
            if self.use_bias:
                local[f"{i}.bias"] = full[f"bias{i}"]
            if singleton_local_shards:
                expert_prefix, offsets = f"{global_index}.{prefix}", sharded_offsets
            else:
                expert_prefix, offsets = prefix, (*sharded_offsets, (ep_axis, global_index, num_global_experts))
            sub = make_sharded_tensors_for_checkpoint(local, "", tp_axis_map, offsets, tp_group=self._tp_group,
                                                      dp_cp_group=dp_cp_group)
            replace_prefix_for_sharding(sub, f"{i}.", expert_prefix)
            result[f"{prefix}weight{i}"] = sub[f"{i}.weight"]
            result[f"{prefix}_extra_state{'' if i == 0 else i}"] = sub[f"{i}._extra_state"]
            if self.use_bias:
                result[f"{prefix}bias{i}"] = sub[f"{i}.bias"]
        edp_rank = _expert_dp_rank(self._pg_collection)
        for sharded in result.values():
            fully_sharded = getattr(sharded, "is_data_parallel_fully_shard", False)
            sharded.replica_id = (*sharded.replica_id[:2], 0 if fully_sharded else edp_rank)
        return result
