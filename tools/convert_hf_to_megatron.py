"""Convert a Hugging Face model (Qwen2/Qwen2.5, Qwen3, Qwen3-MoE, Llama/SmolLM2) to a Megatron distributed checkpoint.

    torchrun --nproc-per-node 2 tools/convert_hf_to_megatron.py --hf-dir MODEL_DIR --out CKPT_DIR --tp 2 --pp 1
    torchrun --nproc-per-node 2 tools/convert_hf_to_megatron.py --hf-dir MOE_DIR --out CKPT_DIR --ep 2 --etp 1
    python tools/convert_hf_to_megatron.py --hf-dir MODEL_DIR --out CKPT_DIR            # one process

The checkpoint (megatron.core.dist_checkpointing, torch_dist format) loads at any TP/PP; it keeps the HF
config and tokenizer files in CKPT_DIR/hf. See megatron_gigpo/actor/convert.py.
"""

import sys

from megatron_gigpo.actor.convert import main_hf_to_megatron

if __name__ == "__main__":  # dist_checkpointing spawns workers: keep the guard
    sys.exit(main_hf_to_megatron())
