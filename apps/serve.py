"""Serve a meshtron decoder over HTTP with OpenAI's API, batching requests as they come.

    python -m apps.serve --ckpt checkpoints/gpt_tiny_stdlib --port 8000
    python -m apps.serve --weights weights/ --cache-tokens 4096 --max-waiting 32
    python -m apps.serve --hf-dir weights-hf/ --chat-template chat.jinja

The model comes from a training checkpoint (``--ckpt``), an exported weights folder
(``--weights``) or a Hugging Face directory (``--hf-dir``); the tokenizer is the one
``tools/generate.py`` would use. Requests run through ``apps.serving``: a paged KV cache of
``--cache-tokens`` tokens (its size is printed at start) and a continuous-batching engine;
``apps/serving/http.py`` has the routes. ``--quantize int8`` keeps the weights in int8
(``engine/models/quantize.py``).

``--tp-size N`` splits the model over N local TP ranks (``apps.generate_text`` starts them
the same way): rank 0 serves HTTP and schedules; at every forward it sends the step's plan
(ids, positions, KV slots) to the others, and every rank runs it on its own shard of the
weights and of the KV cache (its KV heads). Logits are gathered over TP and sampled on
rank 0. SIGTERM drains rank 0, which then stops the others; a failure on any rank stops
them all with one line.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from engine.checkpoint.storage import CheckpointError
from engine.inference import ModelSource
from engine.models.families import decoders
from engine.tool_args import (
    ArgumentParser,
    add_batching_flags,
    add_quantize_flag,
    in_flags,
    port_number,
    positive_float,
    positive_int,
)
from parallel_state.launcher import launch_env_problem

DTYPES = ("float32", "float64", "bfloat16")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = ArgumentParser(prog="serve", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--ckpt", help="training checkpoint root (or step dir) or model export dir")
    src.add_argument("--weights", help="an exported weights folder (export-model's output)")
    src.add_argument("--hf-dir", help="local Hugging Face directory of a decoder")
    p.add_argument("--tokenizer", help="tokenizer.json (default: the one saved with the model)")
    p.add_argument("--chat-template", help="a Jinja chat template (default: tokenizer_config's)")
    p.add_argument(
        "--served-model-name",
        help="the model name clients send (default: the directory's, or for a run's step or final, the run's)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=8000, help="0: any free port")
    p.add_argument(
        "--cache-tokens",
        type=positive_int,
        help="KV cache size in tokens (default: --max-running × the model's positions)",
    )
    p.add_argument("--max-running", type=positive_int, default=16, help="sequences per step")
    add_batching_flags(p)
    p.add_argument(
        "--max-waiting",
        type=positive_int,  # 0 would refuse every request: the queue is the way in
        default=64,
        help="queued requests past which new ones get 429",
    )
    p.add_argument(
        "--max-body-mb",
        type=positive_float,
        default=16,
        help="request bodies over this many MiB get 413, refused before they are read whole "
        "(default 16)",
    )
    p.add_argument(
        "--tp-size",
        type=positive_int,
        default=1,
        help="tensor-parallel ranks to start (divides the heads)",
    )
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    add_quantize_flag(
        p,
        "int8: the layers' linears, the LM head and the word embedding as int8 with "
        "per-output-channel scales, dequantized in the matmul (engine/models/quantize.py)",
    )
    return p.parse_args(argv)


def _source(args: argparse.Namespace) -> tuple[ModelSource, str]:
    """The model's source and its tokenizer path; raises with one line when either is
    missing or the model cannot generate."""
    source = ModelSource(args.ckpt or args.weights, args.hf_dir)
    if args.weights and source.kind() != "export":
        raise ValueError(f"--weights {args.weights} is not an exported weights folder")
    cfg = source.config()
    if not cfg.causal:
        raise ValueError(f"{cfg.arch} is not a decoder: only decoders ({decoders()}) generate")
    source.check_weights()  # a damaged weights file is named before any rank starts
    tokenizer = args.tokenizer or source.tokenizer_path()
    if tokenizer is None or not os.path.isfile(tokenizer):
        raise FileNotFoundError("no tokenizer found beside the model: pass --tokenizer PATH")
    if args.chat_template:
        if not os.path.isfile(args.chat_template):
            raise FileNotFoundError(f"--chat-template {args.chat_template}: no such file")
        from apps.serving.text import compile_template

        # here, before any rank starts or weights load: one line when it does not parse
        template = Path(args.chat_template).read_text()
        compile_template(template, f"--chat-template {args.chat_template}")
    return source, tokenizer


def check_tp(args: argparse.Namespace, cfg) -> None:
    """Refuse, in one line before any rank starts, a --tp-size the model or the machine
    cannot run: it must divide the heads (and what else the model splits), and each rank
    needs a GPU of its own, or on CPU a core of its own."""
    if args.tp_size == 1:
        return
    cfg.validate(args.tp_size)  # its line names tp_size, which main words as --tp-size
    import torch

    from engine.launching import usable_cores

    if torch.cuda.is_available():
        have, what = torch.cuda.device_count(), "GPUs"
    else:
        have, what = usable_cores(), "usable CPU cores"
    if "RANK" not in os.environ and args.tp_size > have:
        raise ValueError(f"--tp-size {args.tp_size}: this machine has {have} {what}, one a rank")


def build(args: argparse.Namespace, ps=None, channel=None):
    """The FastAPI app for ``args``, and the KV cache's one-line description. ``ps``: this
    rank's ParallelState at tp > 1 (the model is its shard), whose other ranks follow the
    plans ``channel`` sends (:func:`serve_rank`)."""
    from apps.serving import ServingEngine
    from apps.serving.http import build_app
    from apps.serving.text import TextCodec

    source, tokenizer = _source(args)
    codec = TextCodec.from_files(tokenizer, args.chat_template, arch=source.config().arch)
    model, cache = _model_and_cache(args, source, ps)
    engine = ServingEngine(
        model,
        cache,
        max_running=args.max_running,
        max_waiting=args.max_waiting,
        token_budget=max(args.token_budget, args.max_running),
        channel=channel,
    )
    name = args.served_model_name or source.name()
    line = cache.describe()
    if args.tp_size > 1:
        line += f" on each of {args.tp_size} TP ranks"
    app = build_app(engine, codec, name, max_body_bytes=int(args.max_body_mb * 2**20))
    return app, line


def _model_and_cache(args: argparse.Namespace, source: ModelSource, ps=None):
    """This rank's model (its TP shard under ``ps``) and its paged KV cache."""
    import torch

    from apps.serving import PagedKVCache
    from engine.inference import inference_config
    from engine.models import build_model
    from engine.models.quantize import quantize_model_

    cfg, state = source.load(ps)
    dtype = getattr(torch, args.dtype)
    if ps is None:
        model = build_model(inference_config(cfg), dtype=dtype)
    else:
        model = build_model(inference_config(cfg), ps, dtype=dtype, device=ps.device)
    model.load_full_state_dict(state)
    del state
    quantize_model_(model, args.quantize)
    tokens = args.cache_tokens or args.max_running * cfg.max_positions
    return model, PagedKVCache.for_model(model, tokens=tokens, block_size=args.block_size)


def _serve(app, cache_line: str, sock: socket.socket, *, graceful_s: int = 30) -> None:
    """Print the cache and the address, serve until SIGINT/SIGTERM (or until
    ``app.state.uvicorn.should_exit``), then drain for at most ``graceful_s``."""
    import uvicorn

    host, port = sock.getsockname()[:2]
    print(cache_line, flush=True)
    print(f"serving {app.state.server.model_name} on http://{host}:{port}", flush=True)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=graceful_s)
    # uvicorn drains on SIGINT/SIGTERM, then raises the signal again to the handler it
    # found: with these, nothing is left to stop and the drained server exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server = uvicorn.Server(config)
    app.state.uvicorn = server
    server.run(sockets=[sock])


def serve_rank(args: argparse.Namespace, launched: bool = False) -> int:
    """One TP rank of ``--tp-size N``: rank 0 serves HTTP and schedules, sending each
    forward's plan to the others, which run it on their shard until rank 0 stops. Returns
    the rank; raises (one line, in the launcher) on a failure.

    ``launched``: started by :func:`_launch`, whose workers, once their function returns,
    wait for the launcher to collect the result; but a launcher that passed SIGTERM on
    only waits 30 s for them to end, then kills them. So a rank that stopped cleanly
    exits 0 itself, at once."""
    from apps.serving.engine import follow
    from apps.serving.tp import PlanChannel
    from engine.bootstrap import bootstrap_rank
    from engine.config import sized_dims

    def say(ps, line: str) -> None:
        if ps.rank == 0:
            print(line, file=sys.stderr, flush=True)

    mesh = bootstrap_rank(lambda world: sized_dims(args.tp_size, None, world), say=say)
    with mesh as ps:
        channel = PlanChannel(ps.tp_group)
        if not channel.is_source:
            # Rank 0 leads the drain and then sends the stop: a signal here changes nothing.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
            source, _ = _source(args)
            model, cache = _model_and_cache(args, source, ps)
            steps = follow(model, cache, channel)
            _stopped(f"serve: rank {ps.rank} stopped after {steps} forwards", launched)
            return ps.rank
        app, line = build(args, ps, channel)
        engine = app.state.server.engine
        failed: list[BaseException] = []
        step = engine.step

        def step_or_stop():
            # At tp > 1 a failed step leaves the ranks out of step: stop them all.
            try:
                return step()
            except BaseException as err:
                failed.append(err)
                app.state.uvicorn.should_exit = True
                raise

        engine.step = step_or_stop
        sock = bind(args)
        # Inside the launcher's 30 s between passing SIGTERM on and killing the ranks.
        _serve(app, line, sock, graceful_s=20)
        if failed:
            raise RuntimeError(f"a step failed, every rank stops: {failed[0]}") from failed[0]
        channel.send(None)
        _stopped(f"serve: rank {ps.rank} stopped", launched)
        return ps.rank


def _stopped(line: str, launched: bool) -> None:
    """Say that this rank stopped cleanly; exit 0 now when :func:`_launch` started it."""
    # one write of the whole line: the ranks share the terminal, and print's separate
    # write of the newline let another rank's line land in between
    sys.stderr.write(f"{line}\n")
    sys.stderr.flush()
    if launched:
        sys.stdout.flush()
        os._exit(0)


def _launch(args: argparse.Namespace) -> int:
    """Start ``--tp-size`` local ranks and wait for them; one line when one fails."""
    import torch.distributed.launcher.api  # noqa: F401 - its loggers, made on import
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from engine.launching import launch_workers

    # The launcher logs each step of a stop, and a failed rank's traceback as a screenful
    # of its own frames: the one line below says what happened instead.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        launch_workers(serve_rank, args, True, nproc_per_node=args.tp_size)
    except SignalException:
        # The launcher passed the signal on: rank 0 drained and stopped the others.
        return 0
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", "")
        first = (str(message).strip().splitlines() or ["no message"])[0]
        print(
            f"serve: rank {rank} failed (exit code {failure.exitcode}): {first}; every rank "
            "stopped",
            file=sys.stderr,
        )
        return 1
    return 0


def bind(args: argparse.Namespace) -> socket.socket:
    """The server's listening socket on --host:--port; a port in use or a host that is no
    address of this machine is one line saying which flag to change."""
    try:
        return socket.create_server((args.host, args.port))
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise OSError(
                f"--port {args.port} on {args.host} is in use: pass another --port (0: any "
                "free port)"
            ) from None
        if err.errno == errno.EADDRNOTAVAIL:
            raise OSError(
                f"--host {args.host} is no address of this machine: pass one of its "
                "addresses (127.0.0.1; 0.0.0.0 for all of them)"
            ) from None
        raise


def main(argv: list[str] | None = None) -> int:
    """Load, print the cache size and the address, serve until SIGINT/SIGTERM; 2 on a bad
    argument. At --tp-size N, start N local ranks (under torchrun, this process is one)."""
    args = parse_args(argv)
    try:
        if problem := launch_env_problem():  # before a rank reads it
            raise ValueError(problem)
        source, _ = _source(args)
        check_tp(args, source.config())
        sock = bind(args)  # before the weights load: a port in use is said at once
        if args.tp_size > 1 or "RANK" in os.environ:
            sock.close()  # rank 0 binds it later
            if "RANK" in os.environ:
                return 0 if serve_rank(args) >= 0 else 1
            return _launch(args)
        app, cache_line = build(args)
    except (OSError, ValueError, CheckpointError) as err:
        print(f"serve: {in_flags(str(err), {'--tp-size'})}", file=sys.stderr)
        return 2
    _serve(app, cache_line, sock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
