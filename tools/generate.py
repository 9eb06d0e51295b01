"""Sample text from a trained meshtron GPT, an exported model or a Hugging Face GPT-2.

    python tools/generate.py --ckpt checkpoints/gpt_tiny_stdlib --prompt "def " --prompt "class "
    python tools/generate.py --ckpt checkpoints/gpt_tiny_stdlib/final --tp-size 2 --greedy
    python tools/generate.py --hf-dir ./gpt2 --tokenizer ./gpt2/tokenizer.json --prompt "Hello"

A thin front over the application ``apps.generate_text`` (its docstring has the details).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from apps.generate_text import main, parse_args  # noqa: E402

__all__ = ["main", "parse_args"]

if __name__ == "__main__":
    from engine.tool_args import run_tool

    run_tool(main)
