"""`layerswap demo`: a tiny MoE checkpoint, loaded stock and with its -quant bundle under bitsandbytes 4-bit."""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path

import torch


def _tiny_checkpoint(model_type: str, directory: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from .testing.tiny import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, vocab_size=256)).eval()
    model.save_pretrained(directory)
    return model


def _greedy(model: torch.nn.Module, prompt: torch.Tensor) -> list[int]:
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    return out[0, prompt.shape[1] :].tolist()


def run_demo(model_type: str = "qwen2_moe") -> int:
    os.environ.setdefault("TQDM_DISABLE", "1")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from transformers.utils import logging

    import layerswap

    logging.set_verbosity_error()
    warnings.filterwarnings("ignore", module="bitsandbytes")
    bundle = f"{model_type}-quant"
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    prompt = torch.tensor([[1, 17, 42, 99, 7]])
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint, saved = Path(tmp) / "stock", Path(tmp) / "saved"
        reference = _tiny_checkpoint(model_type, checkpoint)
        with torch.no_grad():
            reference_logits = reference(prompt).logits
        rows = {"unquantized": reference}
        # Stock needs its 1-wide shared_expert_gate kept out by hand (bitsandbytes' CPU kernels reject it);
        # the bundle does that by default.
        stock_nf4 = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            llm_int8_skip_modules=["shared_expert_gate", "lm_head"],
        )
        rows["stock + nf4"] = AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=stock_nf4)
        with layerswap.use_bundle(bundle):
            rows[f"{bundle} + nf4"] = AutoModelForCausalLM.from_pretrained(
                checkpoint, quantization_config=nf4
            )
            unquantized_swapped = AutoModelForCausalLM.from_pretrained(checkpoint)
            unquantized_swapped.save_pretrained(saved)

        print(f"layerswap demo: a tiny {model_type} checkpoint (made locally), loaded three ways\n")
        header = f"{'':24}{'experts quantized':>19}{'footprint':>12}{'max |logit diff|':>18}   greedy tokens"
        print(header)
        print("-" * len(header))
        for label, model in rows.items():
            summary = layerswap.report(model)
            with torch.no_grad():
                diff = (model(prompt).logits - reference_logits).abs().max().item()
            share = f"{summary.expert_quantized_share:.0%}"
            footprint = f"{model.get_memory_footprint() / 2**20:.2f} MiB"
            print(f"{label:<24}{share:>19}{footprint:>12}{diff:>18.4f}   {_greedy(model, prompt)}")

        stock_reload, info = AutoModelForCausalLM.from_pretrained(saved, output_loading_info=True)
        ref_state, reload_state = reference.state_dict(), stock_reload.state_dict()
        identical = ref_state.keys() == reload_state.keys() and all(
            torch.equal(ref_state[k], reload_state[k]) for k in ref_state
        )
        problems = sum(len(v) for k, v in info.items() if k != "error_msgs")
        print(
            f"\nsaved with {bundle}, reloaded with stock transformers: {problems} missing/unexpected keys, "
            f"tensors {'bit-identical' if identical else 'DIFFERENT'} to the original"
        )
    return 0 if identical and problems == 0 else 1
