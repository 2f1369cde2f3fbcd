"""Per-expert FP8 metadata in Megatron's distributed checkpoints of grouped (MoE) linears.

A GroupedLinear keeps one `_extra_state` for all its local experts. megatron-core 0.16.1's TEGroupedLinear
checkpoints it per expert, so that a checkpoint saved with one expert-parallel layout loads with another:
`_split_extra_state` cuts it into one entry per expert, `_sharded_state_dict_grouped` stores expert i's as
`_extra_state` of that expert's shard (`_extra_state{i}` in the module's sharded state dict), and on load
the entries are merged back (`_extra_state1..n-1` into `_extra_state`) before the module reads them.

This plugin's own pieces are each expert's entry as a one-GEMM module keeps it (a sequential expert's linear), so
the two kinds of expert layers load each other's checkpoints and the expert-parallel layout may change. With
extra_state_format "te" the pieces are TransformerEngine's, cut as megatron-core cuts TE's GroupedLinear entry
(te_extra_state.split_te_grouped_payload), so Megatron's TE code merges them back; TE's pieces are read by
merging them the same way, then reading the whole entry in the layout its slots show.
"""
from __future__ import annotations

import io
from typing import Any, Optional

import torch
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding

from mindspeed_te.distributed import group_rank, group_size
from mindspeed_te.megatron.compat import make_sharded_tensors
from mindspeed_te.modules.base import EXTRA_STATE_SLOTS, EXTRA_STATE_VERSION, decode_extra_state, encode_extra_state
from mindspeed_te.recipe_state import BACKWARD_ROLES, FORWARD_ROLES
from mindspeed_te.te_extra_state import (
    ExtraStateRefused,
    encode_te_payload,
    is_te_payload,
    load_extra_state_payload,
    merge_te_expert_payloads,
    split_te_grouped_payload,
)

__all__ = ["GroupedExtraStateMixin"]


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
    """Mixed into TEGroupedLinear (needs FP8ModuleBase's slot layout, `use_bias`, `_tp_group`, `_pg_collection`)."""

    def _encode_extra_state(self, state: dict[str, Any]) -> torch.Tensor:
        return encode_extra_state(state)

    def _decode_extra_state(self, state: Any) -> Optional[dict[str, Any]]:
        """The metadata dict, or None for an entry without FP8 state (this plugin's or TransformerEngine's)."""
        return decode_extra_state(state, type(self).__name__, grouped=self._te_grouped())

    def _te_payload(self, state: Any) -> Optional[dict[str, Any]]:
        """TE's dict when the entry is TransformerEngine's, else None (this plugin's entry, or no FP8 state); read
        without running its code. An unreadable entry raises the clear error _decode_extra_state gives."""
        if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
            return None
        if not isinstance(state, (torch.Tensor, io.BytesIO)):
            self._decode_extra_state(state)  # raises, naming the type
        raw = state.detach().cpu().numpy().tobytes() if isinstance(state, torch.Tensor) else state.getvalue()
        try:
            payload = load_extra_state_payload(raw, type(self).__name__)
        except ExtraStateRefused:
            raise
        except Exception:  # noqa: BLE001  (undecodable: the load's own error says so)
            self._decode_extra_state(state)
            raise
        ours = isinstance(payload, dict) and "recipe_key" in payload
        return payload if is_te_payload(payload) and not ours else None

    def _split_extra_state(self, state: Any) -> list[Any]:
        """One `_extra_state` per local expert. This plugin's entry: expert i's quantizers (its input, weight and
        output, its grad_output and grad_input) as a one-GEMM module keeps them. TE's entry (extra_state_format
        "te"): megatron-core's pieces of it. Without FP8 metadata every expert gets the entry as it is."""
        payload = self._te_payload(state)
        if payload is not None:
            return [encode_te_payload(piece)
                    for piece in split_te_grouped_payload(payload, self.num_gemms, type(self).__name__)]
        meta = self._decode_extra_state(state)
        if meta is None or meta["recipe_key"] is None:
            return [state] * self.num_gemms
        meta = self._upgrade_extra_state(meta)
        pieces = []
        for i in range(self.num_gemms):
            piece = {key: value for key, value in meta.items() if key not in EXTRA_STATE_SLOTS}
            for key, (forward, dim) in EXTRA_STATE_SLOTS.items():
                if key in meta:
                    slots = [self.fp8_meta_index(role, i) for role in (FORWARD_ROLES if forward else BACKWARD_ROLES)]
                    piece[key] = meta[key].index_select(dim, torch.tensor(slots))
            pieces.append(self._encode_extra_state(piece))
        return pieces

    def _merge_extra_states(self, state_dict: dict[str, Any], prefix: str) -> None:
        """Fold a dist-checkpoint's per-expert `_extra_state`, `_extra_state1`, ... into one `_extra_state`,
        in place. A torch-native checkpoint (one entry) is left alone. TE's pieces become TE's whole entry, as
        megatron-core merges them; set_extra_state then reads it in the layout its slots show."""
        keys = [f"{prefix}_extra_state{i}" for i in range(1, self.num_gemms)]
        if not keys or keys[0] not in state_dict:
            return
        states = [state_dict[f"{prefix}_extra_state"]] + [state_dict.pop(k) for k in keys]
        payloads = [self._te_payload(s) for s in states]
        te_pieces = [p is not None for p in payloads]
        if any(te_pieces):
            if not all(te_pieces):
                raise RuntimeError(f"{type(self).__name__}: the checkpoint's per-expert _extra_state entries "
                                   f"{prefix}_extra_state..{keys[-1]} mix TransformerEngine's entries with others "
                                   "(this plugin's, or ones without FP8 state); they cannot be merged")
            merged = merge_te_expert_payloads(payloads, type(self).__name__)
            state_dict[f"{prefix}_extra_state"] = encode_te_payload(merged)
            return
        metas = [self._decode_extra_state(s) for s in states]
        if any(m is None or m["recipe_key"] is None for m in metas):
            return  # saved before (or without) FP8: the first entry says so
        merged = {key: value for key, value in metas[0].items() if key not in EXTRA_STATE_SLOTS}
        merged["version"] = EXTRA_STATE_VERSION
        for key, (forward, dim) in EXTRA_STATE_SLOTS.items():
            if key in metas[0]:  # experts one after another (per GEMM), then in this module's layout
                per_gemm = torch.cat([m[key] for m in metas], dim=dim)
                merged[key] = per_gemm.index_select(dim, torch.tensor(self.per_gemm_order(forward)))
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
            sub = make_sharded_tensors(local, "", tp_axis_map, offsets, tp_group=self._tp_group,
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
