"""Convert a Megatron distributed checkpoint (any TP/PP/EP) to a Hugging Face model directory.

    torchrun --nproc-per-node 2 tools/convert_megatron_to_hf.py --megatron-dir CKPT_DIR --out HF_DIR --tp 1 --pp 2
    torchrun --nproc-per-node 2 tools/convert_megatron_to_hf.py --megatron-dir MOE_CKPT --out HF_DIR --ep 2 --etp 1
    python tools/convert_megatron_to_hf.py --megatron-dir CKPT_DIR --out HF_DIR            # one process

Weights are gathered to rank 0 one safetensors shard (--max-shard-size-mb) at a time; config and tokenizer
files come from CKPT_DIR/hf (or --hf-config-dir). See megatron_gigpo/actor/convert.py.
"""

import sys

from megatron_gigpo.actor.convert import main_megatron_to_hf

if __name__ == "__main__":  # dist_checkpointing spawns workers: keep the guard
    sys.exit(main_megatron_to_hf())
