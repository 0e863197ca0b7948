"""Tiny random configs for composite (vision/audio + MoE text) transformers v5 model types.

Generic recipe:
  * every sub-config that holds a decoder ("text" role: the root of a flat config, any `text_config`, the omni
    talker's text/code-predictor configs) gets the _TEXT settings (where the config has the attribute), its
    per-layer lists (layer_types, mlp_layer_types, indexer_types, ...) cut down to 2 layers that keep the
    layer-type variety (first layer + first layer of another type) and made all-MoE;
  * every other sub-config (vision / audio / encoder towers) gets the _TOWER settings (where it has them);
  * special token ids that fall outside the tiny vocabulary are remapped: pad/bos/eos -> 0/1/2, the rest
    (image/video/audio/... ids) -> 101, 102, ... (outside 5..100, the ids a text-only test feeds, so text input
    never looks like a placeholder);
  * MLA decoders (kv_lora_rank set) also get _MLA (head_dim follows the default's relation to the rope/nope
    dims), indexed-attention decoders _INDEXED; rope_parameters are copied so families can deep-merge into them,
    and YaRN's original context is shrunk to fit max_position_embeddings;
  * composite roots (and the omni thinker/talker) get _ROOT (untied lm_head, small projector);
  * attn_implementation "eager".
Known limits: only text-only forwards were verified (no pixel/audio input); scipy is not needed.
Per family, _FAMILY lists only what the generic recipe cannot infer, keyed by the dotted sub-config path
("" = root, "text_config", "thinker_config.text_config", ...), each with the reason.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from ._sizes import VOCAB

TEXT_HIDDEN = 64

# Decoder settings (bitsandbytes CPU 4-bit friendly: out_features % 32 == 0, in_features >= 64).
_TEXT: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": TEXT_HIDDEN,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "shared_experts_intermediate_size": 64,
    "shared_intermediate_size": 64,
    "dense_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_local_experts": 8,
    "n_routed_experts": 8,
    "moe_num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_k": 2,
    "top_k_experts": 2,
    "max_position_embeddings": 128,
    # sliding-window attention layers with their own head layout (inkling)
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": 16,
    "unpadded_vocab_size": VOCAB,  # inkling: logits width; the checkpoint conversion pads back up to vocab_size
    "tie_word_embeddings": False,
    # linear-attention (gated delta net / lightning) layers
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_head_dim": 16,
    "linear_num_heads": 4,
    # every layer MoE
    "first_k_dense_replace": 0,
    "mlp_only_layers": [],
    "decoder_sparse_step": 1,
    # grouped routing with 8 experts
    "n_group": 1,
    "topk_group": 1,
}

# Vision / audio / encoder towers: as small as they go (hidden 32, 2 heads of 16, one layer); outputs that feed the
# text model match the text hidden size.
_TOWER: dict[str, Any] = {
    "depth": 1,
    "num_hidden_layers": 1,
    "n_layers": 1,
    "encoder_layers": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "encoder_attention_heads": 2,
    "encoder_ffn_dim": 64,
    "d_model": 32,
    "head_dim": 16,
    "out_hidden_size": TEXT_HIDDEN,
    "output_dim": TEXT_HIDDEN,
    "text_hidden_size": TEXT_HIDDEN,
    "adapter_out_dim": TEXT_HIDDEN,
    "deepstack_visual_indexes": [0],
    "projection_hidden_dim": 64,
    "projection_intermediate_size": 64,
    "num_position_embeddings": 64,  # learned 2D position table (8x8 grid)
    "position_embedding_size": 64,  # gemma4 vision's position table (10240 rows by default)
    "downsample_hidden_size": 16,  # audio conv front-end channels (480 -> 2M params per 3x3 conv)
    # SAM-style image encoders (deepseek_ocr2 / unlimited_ocr): MLP width, neck channels, and the 2-conv
    # downsampler; its last width feeds the next encoder (ocr2: must equal that encoder's hidden_size, 32).
    "mlp_dim": 64,
    "output_channels": 32,
    "downsample_channels": [32, 32],
    "global_attn_indexes": [0],
}

# Multi-head latent attention (deepseek_v3 descendants), applied where the text config has kv_lora_rank: small ranks,
# as many kv heads as heads (MLA has no GQA), one shared expert.
_MLA: dict[str, Any] = {
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_shared_experts": 1,
}
# Sparse (indexed) attention: a small indexer, applied where the config has one.
_INDEXED: dict[str, Any] = {"index_topk": 4, "index_head_dim": 16, "index_n_heads": 2}

# Composite roots: projector widths between the towers and the text model; untied lm_head (several composites,
# e.g. ernie4_5_vl_moe, gemma4, diffusion_gemma, tie at the root even when the text config says False).
_ROOT: dict[str, Any] = {"projector_hidden_size": 64, "tie_word_embeddings": False}

_TOKEN_ATTR = re.compile(r"(token_id|token_index)$")
_SPECIAL = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _is_text(name: str, cfg: PretrainedConfig, parent_role: str | None) -> bool:
    if parent_role is None:  # root
        return not (getattr(type(cfg), "sub_configs", None) or {}) and hasattr(cfg, "vocab_size")
    return name == "text_config" or (parent_role == "talker" and hasattr(cfg, "vocab_size"))


def _pick_layers(default: PretrainedConfig) -> list[int]:
    """Two layer indices: the first, and the first of another layer type (hybrid stacks need both kinds)."""
    lt = getattr(default, "layer_types", None)
    if isinstance(lt, (list, tuple)) and lt:
        for j, v in enumerate(lt):
            if v != lt[0]:
                return [0, j]
    return [0, 1]


def _scaled(tiny: Any, entry: Any, full: Any) -> Any:
    if isinstance(tiny, int) and isinstance(entry, int) and isinstance(full, int) and full:
        return max(1, tiny * entry // full)
    return tiny


# Per-layer overrides (heterogeneous configs' per_layer_config): head counts and head_dim keep their ratio to the
# global value; other tiny settings (ranks, sizes) are used as they are.
_PER_LAYER_SCALED = {"num_attention_heads", "num_key_value_heads", "head_dim"}


def _shrink_text(default: PretrainedConfig) -> dict[str, Any]:
    d = default.to_dict()  # not hasattr: heterogeneous configs refuse global reads of per-layer attributes
    kw = {k: v for k, v in _TEXT.items() if k in d}
    if d.get("kv_lora_rank") is not None:
        kw.update({k: v for k, v in _MLA.items() if d.get(k) is not None})
        # head_dim is the rope part (deepseek_v3 style) or the whole q/k head (nope + rope), as in the default
        dh, dr, dn = d.get("head_dim"), d.get("qk_rope_head_dim"), d.get("qk_nope_head_dim")
        if dh is not None and dh == dr:
            kw["head_dim"] = kw["qk_rope_head_dim"]
        elif dh is not None and dr is not None and dn is not None and dh == dr + dn:
            kw["head_dim"] = kw["qk_rope_head_dim"] + kw["qk_nope_head_dim"]
        else:
            kw.pop("head_dim", None)
    kw.update({k: v for k, v in _INDEXED.items() if k in d})
    if isinstance(d.get("rope_parameters"), dict):  # so families can deep-merge into it
        kw["rope_parameters"] = rope = copy.deepcopy(d["rope_parameters"])
        # YaRN: the pre-extension context must fit in the tiny max_position_embeddings
        for r in [rope, *[v for v in rope.values() if isinstance(v, dict)]]:
            if "original_max_position_embeddings" in r:
                r.update(original_max_position_embeddings=64, factor=2.0)
            if "max_position_embeddings" in r:
                r["max_position_embeddings"] = _TEXT["max_position_embeddings"]
    for k, v in list(
        kw.items()
    ):  # per-modality lists (e.g. ernie's [text, vision] expert sizes): one value each
        if isinstance(d.get(k), list) and not isinstance(v, list):
            kw[k] = [v] * len(d[k])
    n0 = d.get("num_hidden_layers")
    idx = _pick_layers(default)
    for k, v in d.items():
        if k in kw or not isinstance(v, list) or n0 is None or len(v) != n0:
            continue
        if k == "mlp_layer_types":  # all MoE: the non-dense kind
            sparse = [x for x in v if x != "dense"] or v
            kw[k] = [sparse[0]] * 2
        else:
            kw[k] = [v[i] for i in idx]
    plc = d.get("per_layer_config")
    if isinstance(plc, dict):
        new = {}
        for p, i in enumerate(idx):
            entry = plc.get(f"{i:02d}")
            if entry:
                new[f"{p:02d}"] = {
                    k: (_scaled(kw[k], v, d.get(k)) if k in _PER_LAYER_SCALED else kw[k]) if k in kw else v
                    for k, v in entry.items()
                }
        kw["per_layer_config"] = new
    return kw


def _remap_tokens(default: PretrainedConfig, kw: dict[str, Any], ids: dict[int, int]) -> None:
    """Out-of-vocab token ids -> small ids; one mapping for the whole tree, so ids shared by sub-configs stay equal."""
    for k, v in default.to_dict().items():
        if not _TOKEN_ATTR.search(k) or k in kw:
            continue
        vals = v if isinstance(v, list) else [v]
        if not any(isinstance(x, int) and x >= VOCAB for x in vals):
            continue
        if k in _SPECIAL:
            kw[k] = _SPECIAL[k]
        else:
            new = [
                ids.setdefault(x, 101 + len(ids)) if isinstance(x, int) and x >= VOCAB else x for x in vals
            ]
            kw[k] = new if isinstance(v, list) else new[0]


def _deep_update(base: dict, upd: dict) -> dict:
    for k, v in upd.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict) and not k.endswith("per_layer_config"):
            _deep_update(base[k], v)
        else:
            base[k] = v
    return base


def _shrink(default: PretrainedConfig, name: str, role: str | None, ids: dict[int, int]) -> dict[str, Any]:
    text = _is_text(name, default, role)
    if text:
        kw = _shrink_text(default)
    elif role is None or name in ("thinker_config", "talker_config"):
        d = default.to_dict()
        kw = {k: v for k, v in _ROOT.items() if k in d}
    else:
        d = default.to_dict()
        kw = {k: v for k, v in _TOWER.items() if k in d}
        # adapters whose input is the tower's own width
        kw.update(
            {
                k: kw["hidden_size"]
                for k in ("adapter_in_dim", "adapter_input_size")
                if k in d and "hidden_size" in kw
            }
        )
        # per-layer lists / overrides cut to the tower's depth
        n0 = next(
            (
                d[k]
                for k in ("num_hidden_layers", "depth", "n_layers", "encoder_layers")
                if isinstance(d.get(k), int)
            ),
            None,
        )
        n1 = next(
            (kw[k] for k in ("num_hidden_layers", "depth", "n_layers", "encoder_layers") if k in kw), None
        )
        for k, v in d.items():
            if (
                k not in kw
                and isinstance(v, list)
                and n0
                and n1
                and len(v) == n0
                and k != "deepstack_visual_indexes"
            ):
                kw[k] = v[:n1]
        if isinstance(d.get("per_layer_config"), dict) and n1:
            kw["per_layer_config"] = {i: e for i, e in d["per_layer_config"].items() if int(i) < n1}
    my_role = "talker" if name == "talker_config" else ("text" if text else "other")
    for sub in getattr(type(default), "sub_configs", None) or {}:
        sub_default = getattr(default, sub, None)
        if isinstance(sub_default, PretrainedConfig):
            kw[sub] = _shrink(sub_default, sub, my_role, ids)
    _remap_tokens(default, kw, ids)
    return kw


def _nest(path: str, upd: dict) -> dict:
    for part in reversed([p for p in path.split(".") if p]):
        upd = {part: upd}
    return upd


# Per-family overrides: {model_type: {sub-config path: {attr: value}}}; see the comments for why.
_FAMILY: dict[str, dict[str, dict[str, Any]]] = {
    # mrope sections must sum to rotary_dim / 2 (head_dim 16 * partial 0.5 = 8 -> 4); partial 0.25 would leave 2.
    "qwen3_5_moe": {
        "text_config": {"rope_parameters": {"partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]}}
    },
    # mrope sections must sum to head_dim / 2 = 8 (the default [24, 20, 20] is for head_dim 128).
    "qwen3_vl_moe": {"text_config": {"rope_parameters": {"mrope_section": [3, 3, 2]}}},
    "qwen3_omni_moe_thinker": {"text_config": {"rope_parameters": {"mrope_section": [3, 3, 2]}}},
    # Whole omni model (thinker + talker + code2wav). Talker: its MoE block reads shared_expert_intermediate_size,
    # which its config class does not declare (passed as an extra attribute); it consumes the thinker's hidden
    # states (thinker_hidden_size, accept_hidden_layer < 2 layers); codec ids live in the talker's own tiny vocab.
    # code2wav: a small codebook and decoder.
    "qwen3_omni_moe": {
        "thinker_config.text_config": {"rope_parameters": {"mrope_section": [3, 3, 2]}},
        # The thinker's rope index reads vision_start_token_id, which only the talker's config declares (real
        # checkpoints carry it in thinker_config as an extra attribute); one small id for both.
        "thinker_config": {"vision_start_token_id": 125},
        "talker_config": {
            "vision_start_token_id": 125,
            "thinker_hidden_size": TEXT_HIDDEN,
            "accept_hidden_layer": 1,
            "codec_pad_id": 120,
            "codec_bos_id": 121,
            "codec_nothink_id": 122,
            "codec_think_bos_id": 123,
            "codec_think_eos_id": 124,
            "spatial_merge_size": 2,
        },  # read by the talker model, not declared by its config
        "talker_config.text_config": {
            "shared_expert_intermediate_size": 64,
            "rope_parameters": {"mrope_section": [3, 3, 2]},
        },
        "code2wav_config": {"codebook_size": VOCAB, "decoder_dim": 32},
    },
    # mrope over head_dim 16 * partial 0.5 = 8 -> sections sum to 4.
    "glm4v_moe": {"text_config": {"rope_parameters": {"mrope_section": [1, 2, 1]}}},
    # mrope sections sum to head_dim / 2 = 8.
    "ernie4_5_vl_moe": {"text_config": {"rope_parameters": {"mrope_section": [3, 3, 2]}}},
    # The MoE block is off by default (dense Gemma 4); the per-layer-input embeddings (PLE) default to a 262k-row
    # table: shrink it to the tiny vocab, width 64 so its projections stay bnb-friendly (in_features >= 64).
    "gemma4": {
        "text_config": {
            "enable_moe_block": True,
            "vocab_size_per_layer_input": VOCAB,
            "hidden_size_per_layer_input": 64,
        }
    },
    # The decoder denoises a 256-token canvas by default: 8 keeps the forward small.
    # The root tie_word_embeddings (True by default, False here via _ROOT) also ties the decoder's layers, experts
    # included, to the encoder's, as published checkpoints do: tests pass tie_word_embeddings=True for that.
    # transformers 5.15 has no default vision config (None, which its model cannot build); these are the settings
    # the tiny recipe derives from 5.24's default Gemma 4 vision config.
    "diffusion_gemma": {
        "": {"canvas_length": 8},
        "vision_config": {
            "model_type": "gemma4_vision",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "position_embedding_size": 64,
        },
    },
    # Its decoder builds a sliding-window mask for every forward, full-attention layers only or not: None fails.
    "step3p7": {"text_config": {"sliding_window": 16}},
    # The routed experts' width is intermediate_size (dense layers use dense_intermediate_size).
    "minimax_m3_vl": {"text_config": {"intermediate_size": 64}},
    # The vision encoder plans one pixel-shuffle scale per layer; with fewer layers than planned scales it needs
    # scipy's linear_sum_assignment (scipy is not installed; n_layers >= planned scales avoids it).
    # (temporal_patch_size 1 would plan float scales and fail.) patch 2 x temporal 2 plans 3 scales
    # (3 -> 64 -> 1536 channels), so n_layers 3.
    # Audio: one embedding row per (mel bin, quantized level); 16 levels instead of 256.
    "inkling_mm_model": {
        "vision_config": {"n_layers": 3, "patch_size": 2, "temporal_patch_size": 2},
        "audio_config": {"mel_vocab_size": 16},
    },
    # Looped core: the default loops layers 6..17, beyond 2 layers (no loop at all). Loop layer 1 twice; the loop
    # bounds must be multiples of n_layers_per_attn_res_block (and start > 0), hence blocks of 1 layer.
    "inkling2_loop": {
        "text_config": {
            "n_layers_per_attn_res_block": 1,
            "loop_layer_index_start": 1,
            "loop_layer_index_end": 2,
            "loop_num_passes": 2,
        }
    },
    # MLA + per-layer heterogeneity: the sliding (SWA) layers need head_dim == qk_nope_head_dim + qk_rope_head_dim
    # (the default 256 = 192 + 64 is not derivable from the global 128 + 64, so the generic rule drops it).
    "dots3_note": {"text_config": {"head_dim": 32}},
    # mlp_layer_types defaults to None, which the decoder cannot index: make both layers MoE explicitly.
    "deepseek_ocr2": {"text_config": {"mlp_layer_types": ["sparse", "sparse"]}},
    # Its eager attention has no repeat_kv for these layers: kv heads must equal heads (the default is 10/10).
    "unlimited_ocr": {"text_config": {"num_key_value_heads": 4}},
    # mrope sections sum to head_dim / 2 = 8.
    # The indexed-attention layers (default layer 3, kept as the second layer) need the QSA indexer fields, all None
    # by default (kv heads must be 1, budget a multiple of the compress ratio, index head >= rotary dim 16).
    # hc_lowrank 64 (hyper-connection low-rank mixer, 320 by default) keeps in_features >= 64.
    "qwen4_exp": {
        "text_config": {
            "rope_parameters": {"mrope_section": [3, 3, 2]},
            "indexer_n_heads": 2,
            "indexer_kv_heads": 1,
            "indexer_head_dim": 16,
            "indexer_budget": 8,
            "indexer_compress_ratio": 4,
            "hc_lowrank": 64,
        }
    },
    # The indexer pools keys in blocks of index_kpool and index_topk must be a multiple of it.
    # The indexed (DSA) layers are NoPE (the config rejects qk_rope_head_dim > 0; head_dim follows it).
    "glm5_next": {"text_config": {"index_kpool": 2, "qk_rope_head_dim": 0}},
    # mrope sections must sum to qk_rope_head_dim / 2 = 8 (validated by the config).
    # Vision: the learned position table has (max_image_size / patch_size)^2 + 1 rows (16385 by default).
    "hy_v4_vl": {
        "text_config": {"rope_parameters": {"mrope_section": [3, 3, 2]}},
        "vision_config": {"max_image_size": 256},
    },
}


def tiny_composite_config(model_type: str, **overrides: Any) -> PretrainedConfig:
    default = AutoConfig.for_model(model_type)
    kw = _shrink(default, "", None, {})
    for path, upd in _FAMILY.get(model_type, {}).items():
        _deep_update(kw, _nest(path, copy.deepcopy(upd)))
    _deep_update(kw, overrides)
    kw["attn_implementation"] = "eager"
    return AutoConfig.for_model(model_type, **kw)
