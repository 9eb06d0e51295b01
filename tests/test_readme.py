"""Every snippet in README.md runs as shown, and every command in it is accounted for.

"It" is the README and the docs/ pages in ``DOCS`` (the reference its sections link to,
where commands live too), read in a defined order: the README first, then each page in the
order of the README's first link to it.

- Each ```python block runs alone (one process, tp=1) and under a real launcher
  (``torch.distributed.run``, 2 processes, tp=2); its output is checked against the same
  computation done unsplit.
- Each command line (```bash blocks, and ``$ ...`` lines of ```text blocks) is parsed by the
  real parser of its program (Hydra's composition for ``engine.pretrain``, argparse for
  ``tools/*.py``), so a renamed option or key fails here. Cheap ones are also run
  (``RUN``); every other one must be mapped in ``COVERED`` to the test that exercises it,
  or to a stated reason it cannot run here. A README command in neither fails the test.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from engine.config import register_configs
from tests.multiproc import run_ranks, subprocess_env

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
register_configs()

# The docs/ pages whose commands and shown outputs count as the README's own.
DOCS = (
    "docs/TRAINING.md",
    "docs/LAUNCHING.md",
    "docs/MODELS.md",
    "docs/CHECKPOINTS.md",
    "docs/DATA.md",
    "docs/PERFMODEL.md",
    "docs/APPS.md",
    "docs/KERNELS.md",
)


def reading_order() -> list[str]:
    """README.md, then the pages of ``DOCS`` in the order the README first links to each
    (a page the README does not link is an error: nobody would read it in order)."""
    unlinked = [d for d in DOCS if f"]({d}" not in README]
    assert not unlinked, f"README.md links none of {unlinked}"
    return ["README.md", *sorted(DOCS, key=lambda d: README.index(f"]({d}"))]


def documented_text() -> str:
    """The README and its command-holding pages, joined in reading order."""
    return "\n".join((ROOT / path).read_text() for path in reading_order())


# Commands this test runs, with their exit status; what they print must be exactly the
# output the README shows under their ``$ `` line.
RUN = {
    "python -m engine.pretrain tp_size=3": 2,
    "python -m engine.pretrain model.rope_theta=500000": 2,
    "python -m engine.pretrain model.hidden_size=768 model.num_heads=12 model.num_layers=8 "
    "tp_size=1 dp_size=4 trainer.micro_batch=1 trainer.memory_cap_gib=0.75 name=gpt_63m": 2,
    "python tools/plan.py search --model gpt_1.3b --global-batch 512 --gpus 16 --cluster dgx_h100": 0,
    "python tools/plan.py search --model gpt_13b --global-batch 512 --gpus 8 --cluster dgx_h100 --pp 1": 0,
    "python tools/plan.py search --model llama_8b --global-batch 256 --gpus 16 --cluster dgx_h100 --top 3": 0,
    "python tools/plan.py search --model llama_8b --global-batch 256 --gpus 32 --cluster dgx_h100 --top 3": 0,
}

# Every other README command: the test that exercises it ("tests/FILE.py::NAME"), or
# "manual: why" for what needs hardware, a cluster or a network this suite does not have.
COVERED = {
    "pip install torch==2.13.0": "manual: installs packages (network)",
    'pip install -e ".[dev,hf]"': "manual: installs packages (network)",
    "python -m engine.pretrain": "tests/test_engine.py::test_tiny_model_trains_at_tp2_dp2",
    "torchrun --nproc-per-node 4 -m engine.pretrain model=gpt_125m name=gpt_125m tp_size=2 "
    "dp_size=2 trainer.max_steps=100": "tests/test_parallel_state.py::test_detect_launch",
    "srun -N 2 --ntasks-per-node 8 --gpus-per-node 8 python -m engine.pretrain "
    "experiment=gpt_125m_bf16 tp_size=4 dp_size=auto": "tests/test_parallel_state.py::test_detect_launch",
    "mpirun --allow-run-as-root --oversubscribe -np 4 python -m engine.pretrain tp_size=2 dp_size=2 "
    "name=quickstart_mpi": "tests/test_launchers.py::test_mpirun_four_ranks_tp2_dp2",
    "python -m engine.pretrain -m tp_size=1,2,4 dp_size=1": "manual: a sweep of three full runs (minutes); its overrides are composed here",
    "python -m engine.pretrain experiment=bert_tiny_stdlib": "tests/test_engine.py::test_tiny_model_trains_at_tp2_dp2",
    "python -m engine.pretrain checkpoint.init_from=weights-hf name=from_hf "
    "trainer.max_steps=20": "tests/test_init_from.py::"
    "test_a_run_started_from_a_gpt2_directory_begins_at_transformers_own_loss",
    "python -m engine.pretrain experiment=llama_tiny_tp2": "tests/test_engine.py::test_tiny_model_trains_at_tp2_dp2",
    "python -m engine.pretrain pp_size=4 tp_size=1 dp_size=1 model.num_layers=4 name=gpt_tiny_pp4": "tests/test_checkpoint.py::test_reshard_across_pipeline_stages",
    "python -m engine.pretrain tp_size=2 dp_size=2 parallel.dp_shard=full name=quickstart_zero3": "tests/test_fsdp.py::test_checkpoints_move_between_every_dp_shard_mode_exactly",
    "python -m engine.pretrain tp_size=1 dp_size=4 parallel.dp_shard=full parallel.dp_replicate=2 "
    "name=hsdp_2x2": "tests/test_hsdp.py::test_checkpoints_move_between_hybrid_and_none_exactly",
    "python tools/preprocess_data.py --input 'corpus/*.txt' --output-prefix data/mycorpus "
    "--vocab-size 32000 --workers 8": "tests/test_data.py::test_cli_success_and_errors",
    "python tools/preprocess_data.py --input docs.jsonl --json-key text --output-prefix "
    "data/docs --tokenizer data/mycorpus.tokenizer.json": "tests/test_data.py::test_jsonl_json_key",
    "python -m engine.pretrain data.prefixes=[data/mycorpus,data/docs] data.weights=[0.7,0.3] "
    "model.vocab_size=32000 name=mycorpus": "tests/test_data.py::test_blend_tracks_weights_in_every_prefix",
    "python tools/preprocess_data.py --input 'fineweb/**/*.parquet' --text-key text --output-prefix "
    "data/fw --tokenizer data/mycorpus.tokenizer.json --format megatron": "tests/test_data_formats.py::test_compressed_and_parquet_inputs_give_plain_jsonl_tokens",
    "python tools/preprocess_data.py convert data/fw --to meshtron --tokenizer "
    "data/mycorpus.tokenizer.json": "tests/test_data_formats.py::test_convert_rewrites_only_the_index",
    "python -m engine.pretrain data.prefixes=[data/my-gpt2_text_document] "
    "data.tokenizer=gpt2/tokenizer.json model.vocab_size=50304 name=megatron_gpt2": "tests/test_data_formats.py::test_megatron_core_pair_trains",
    "python -m engine.pretrain tp_size=4 dp_size=1 trainer.max_steps=170 optim.decay_steps=130": "tests/test_checkpoint.py::test_reshard_model_and_optimizer_across_layouts",
    "python -m engine.pretrain tp_size=1 dp_size=4 optim.distributed=true trainer.max_steps=180 "
    "optim.decay_steps=130": "tests/test_zero.py::test_zero1_checkpoint_loads_at_other_dp_and_without_zero",
    "python -m engine.pretrain trainer.max_restarts=3 trainer.max_steps=190 optim.decay_steps=130": "tests/test_checkpoint.py::test_killed_worker_restarts_and_resumes_bitwise",
    "torchrun --standalone --nproc-per-node 4 --max-restarts 3 -m engine.pretrain "
    "trainer.max_steps=200 optim.decay_steps=130": "tests/test_checkpoint.py::test_killed_worker_restarts_and_resumes_bitwise",
    "python tools/checkpoint.py inspect checkpoints/gpt_tiny_stdlib": "tests/test_checkpoint.py::test_inspect_convert_and_export_cli",
    "python tools/checkpoint.py convert checkpoints/gpt_tiny_stdlib --tp-size 4 --dp-size 1 "
    "--out checkpoints/gpt_tiny_tp4": "tests/test_checkpoint.py::test_inspect_convert_and_export_cli",
    "python tools/checkpoint.py export-model checkpoints/gpt_tiny_stdlib --out weights/": "tests/test_checkpoint.py::test_inspect_convert_and_export_cli",
    "python tools/verify_equivalence.py --model gpt --tp-size 2 --dp-size 2 --sequence-parallel "
    "--recompute selective": "tests/test_verify.py::test_planted_bugs_are_named_where_they_first_show",
    "python tools/verify_equivalence.py --model llama --tp-size 1 --dp-size 2 --ep-size 2 "
    "--heads 4 --capacity-factor 1.0": "tests/test_verify_moe.py::test_dp2_ep2_equals_the_unsplit_model_in_fp64",
    "python tools/convert_hf.py import --hf-dir path/to/gpt2 --out ckpt/gpt2": "tests/test_hf.py::test_command_line_tools",
    "python tools/convert_hf.py export --ckpt ckpt/gpt2 --out path/to/gpt2-again": "tests/test_hf.py::test_command_line_tools",
    "python -m engine.pretrain model=llama_tiny data.document_mask=true tp_size=1 dp_size=1 "
    "name=llama_tiny_docs": "tests/test_document_mask.py::test_packed_documents_equal_one_document_per_row",
    "python -m engine.pretrain model=llama_tiny cp_size=2 tp_size=1 dp_size=1 data.seq_len=128 "
    "trainer.max_steps=30 name=llama_tiny_cp2": "tests/test_context_parallel.py::test_cp2_equals_the_unsplit_model",
    "python -m engine.pretrain model=llama_tiny cp_size=4 tp_size=1 dp_size=1 data.seq_len=16384 "
    "model.max_positions=16384 trainer.max_steps=10 trainer.global_batch=1 trainer.micro_batch=1 "
    "trainer.log_every=1 trainer.eval_every=0 trainer.sample_tokens=0 trainer.progress=false "
    "trainer.tensorboard=false optim.warmup_steps=2 name=llama_tiny_cp4_16k": "manual: 18 minutes on "
    "2 cores (docs/BENCHMARKS.md); its overrides are composed here and the same path runs at 128 "
    "tokens in tests/test_context_parallel.py::test_cp2_equals_the_unsplit_model",
    "python -m engine.pretrain model=moe_tiny tp_size=1 dp_size=2 ep_size=2 trainer.max_steps=30 "
    "name=moe_tiny_ep2": "tests/test_moe_ep.py::test_ep2_equals_the_unsplit_model",
    "python tools/gpu_check.py --rehearse --out bench/gpu_check": "tests/test_gpu_check.py::test_rehearsal_runs_every_item_and_writes_the_table",
    "python tools/gpu_check.py --out bench/gpu_check": "manual: GPU measurements; every item's path rehearsed in test_rehearsal_runs_every_item_and_writes_the_table",
    "python tools/bench_kernels.py --smoke": "tests/test_kernels.py::test_bench_kernels_smoke",
    "python tools/bench_kernels.py --out bench/": "manual: GPU timings; CPU path in test_bench_kernels_smoke",
    "python tools/bench_train.py --preset gpt_tiny --hidden 256 --layers 4 --seq 128 "
    "--micro-batch 8 --vocab 8192 --threads 1 --references eager,compile,mcore": "tests/test_bench_cli.py::test_bench_bad_flags",
    "python tools/count_host_syncs.py": "tests/test_optim.py::test_norm_and_clipping_are_exact_and_never_sync",
    "python tools/count_graph_breaks.py --recompute full": "tests/test_compile.py::test_graph_break_tool_counts_what_dynamo_reports",
    "python tools/count_graph_breaks.py --kernels triton --no-update": "tests/test_compile.py::test_graph_break_tool_counts_what_dynamo_reports",
    "python tools/bench_checkpoint.py --preset gpt_tiny --rounds 1": "tests/test_tensorfile.py::test_checkpoint_benchmark_runs_every_side",
    "python -m engine.pretrain trainer.max_steps=160 optim.decay_steps=130": "tests/test_failures.py::test_extending_max_steps_with_a_fixed_schedule_is_bitwise_the_longer_run",
    "python tools/scaling_study.py --model gpt_tiny --steps 5 --warmup 2 --dp 1,2,4 --nodes 1,2 "
    "--cluster emulated_1gbit --out dp_1gbit": "tests/test_scaling.py::test_emulated_two_nodes_train_and_links_hold_the_configured_rate",
    "torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK --master-addr node01 "
    "--master-port 29500 -m engine.pretrain model=gpt_350m tp_size=8 dp_size=auto name=gpt_350m_2nodes": "tests/test_k8s.py::test_indexed_job_command_trains_as_two_local_pods",
    "torchrun --nnodes 1:2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node01:29400 "
    "--rdzv-id myjob --max-restarts 5 -m engine.pretrain model=gpt_350m tp_size=8 dp_size=auto "
    "checkpoint.every=100 name=gpt_350m_elastic": "tests/test_elastic.py::test_dp_shrinks_when_a_node_dies_and_grows_when_it_returns",
    "srun -N 2 --ntasks-per-node 8 --gpus-per-node 8 python -m engine.pretrain model=gpt_350m tp_size=8 "
    "dp_size=auto name=gpt_350m_srun": "tests/test_slurm.py::test_srun_four_tasks_dp_auto",
    "mkdir -p logs": "manual: a plain mkdir before sbatch (the sbatch test makes its own)",
    "sbatch tools/launch/slurm/pretrain.sbatch model=gpt_350m tp_size=8": "tests/test_slurm.py::test_sbatch_template_requeues_after_usr1_and_finishes",
    "sbatch --nodes=4 tools/launch/slurm/pretrain.sbatch model=gpt_1.3b tp_size=8": "tests/test_slurm.py::test_sbatch_template_requeues_after_usr1_and_finishes",
    "python -m engine.pretrain -m hydra/launcher=slurm hydra.launcher.partition=gpu tp_size=2,4,8 "
    "dp_size=auto 'checkpoint.dir=checkpoints/${hydra:job.override_dirname}'": "tests/test_launchers.py::test_hydra_sweep_through_submitit_local_launcher",
    "mpirun -np 16 -npernode 8 --hostfile hosts -x MASTER_ADDR=node01 -x MASTER_PORT=29500 -x PATH "
    "python -m engine.pretrain model=gpt_350m tp_size=8 dp_size=auto name=gpt_350m_mpi": "tests/test_launchers.py::test_mpirun_four_ranks_tp2_dp2",
    "mpirun --allow-run-as-root --oversubscribe -np 4 -x MASTER_ADDR -x MASTER_PORT -x PYTHONPATH "
    "python -m engine.pretrain tp_size=2 dp_size=2 … trainer.log_every=3": "tests/test_launchers.py::test_mpirun_four_ranks_tp2_dp2",
    "tools/launch/mpi/netns-rsh mtrnbe14b8n0 mpirun --allow-run-as-root --hostfile hosts -np 4 "
    '--map-by ppr:2:node --mca plm_rsh_agent "$PWD/tools/launch/mpi/netns-rsh" -x '
    "MASTER_ADDR=10.213.0.1 -x MASTER_PORT=29500 -x PYTHONPATH python -m engine.pretrain "
    "tp_size=2 dp_size=2 … trainer.log_every=3": "tests/test_launchers.py::test_mpirun_hostfile_on_two_emulated_nodes_keeps_tp_inside_a_node",
    "kubectl apply -k tools/launch/k8s/overlays/example": "tests/test_k8s.py::test_example_overlay_renders_consistent_valid_objects",
    "kubectl apply -f tools/launch/k8s/pytorchjob/pytorchjob.yaml": "tests/test_k8s.py::test_pytorchjob_matches_the_operator_fields_and_its_pods_are_valid",
    "apt-get update -q": "manual: installs packages (network); .ci/run does it",
    "python -m apps.classify --help": "tests/test_classify.py::test_config_errors_exit_2_before_any_rank",
    "OMP_NUM_THREADS=1 python -m apps.classify": "tests/test_classify.py::test_two_ranks_reach_085_on_the_full_data_set",
    "python -m apps.classify --num-gpus 4 --target-accuracy 0.85 --batch-size 64 --epochs 10": "tests/test_classify.py::test_two_ranks_reach_085_on_the_full_data_set",
    "python -m apps.classify --num-gpus 4 --tp-size 2": "tests/test_classify.py::test_dp_gradients_equal_the_whole_batch_gradients",
    "MASTER_ADDR=node0 MASTER_PORT=29400 python -m apps.classify --num-nodes 2 --node-id 0 --num-gpus 4": "manual: two machines; run by hand as two 'nodes' on one machine (docs/SCALING.md)",
    "MASTER_ADDR=node0 MASTER_PORT=29400 python -m apps.classify --num-nodes 2 --node-id 1 --num-gpus 4": "manual: two machines; run by hand as two 'nodes' on one machine (docs/SCALING.md)",
    "torchrun --standalone --nproc-per-node 4 -m apps.classify": "manual: the same worker as the self-launched test, started by torchrun; run by hand",
    "apt-get install -y -q openmpi-bin": "manual: installs packages (network); .ci/run does it",
    "apt-get install -y -q slurm-wlm": "manual: installs packages (network); .ci/run does it",
    "apt-get install -y -q munge": "manual: installs packages (network); .ci/run does it",
    "apt-get install -y -q kubernetes-client": "manual: installs packages (network); .ci/run does it",
    "apt-get install -y -q iproute2": "manual: installs packages (network); .ci/run does it",
    "apt-get install -y -q dataset-fashion-mnist": "manual: installs packages (network); .ci/run does it",
    'python tools/generate.py --ckpt checkpoints/gpt_tiny_stdlib --tp-size 2 --prompt "def " '
    '--prompt "import os" --max-new-tokens 40 --top-p 0.95': "tests/test_generate_tool.py::test_tool_at_tp2_prints_what_tp1_generates_in_process",
    "python -m pytest -q -n 2 --dist loadfile": "manual: the whole suite (this test is part of it)",
    'python -m pytest -q -m "not slow"': "manual: the quick subset of the suite (this test is part of it)",
    "python tools/convert_hf.py export --ckpt weights/ --out weights-hf/": "tests/test_generate_tool.py::test_exports_carry_the_tokenizer_so_generation_needs_no_flag",
    'python tools/generate.py --hf-dir weights-hf/ --prompt "def " --max-new-tokens 24 --greedy': "tests/test_generate_tool.py::test_exports_carry_the_tokenizer_so_generation_needs_no_flag",
    "python -m apps.serve --ckpt checkpoints/gpt_tiny_stdlib": "tests/test_serve.py::test_the_command_prints_the_cache_serves_and_drains_on_sigterm",
    "curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{\"model\": "
    '"gpt_tiny_stdlib", "prompt": "def ", "max_tokens": 16, "temperature": 0}\'': "tests/test_serve.py::test_greedy_completion_equals_generate_and_the_tool",
    "curl -sN localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{\"model\": "
    '"gpt_tiny_stdlib", "prompt": "import os", "max_tokens": 3, "stream": true, "seed": 1}\'': "tests/test_serve.py::test_streamed_chunks_add_up_to_the_answer",
    'python -c \'from openai import OpenAI; c = OpenAI(base_url="http://127.0.0.1:8000/v1", '
    'api_key="-"); print(repr(c.completions.create(model="gpt_tiny_stdlib", prompt="class ", '
    "max_tokens=24, temperature=0.8, seed=7).choices[0].text))'": "tests/test_serve.py::test_seeds_reproduce_and_equal_generate",
    "python -m apps.serve --weights /tmp/tpserve/tiny --port 8125 --cache-tokens 1024 --tp-size 2": "tests/test_serve_tp.py::test_tp2_greedy_tokens_and_logprobs_equal_tp1_and_generate",
    "curl -s localhost:8125/v1/completions -H 'Content-Type: application/json' -d '{\"model\": "
    '"tiny", "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0, "logprobs": 1}\'': "tests/test_serve_tp.py::test_tp2_greedy_tokens_and_logprobs_equal_tp1_and_generate",
    "kill -TERM <the serve process>": "tests/test_serve_tp.py::test_tp2_sigterm_drains_and_every_rank_exits_0",
    "python -m apps.serve --ckpt checkpoints/gpt_tiny_stdlib --quantize int8 --port 8731": "tests/test_quantize.py::test_int8_server_answers_greedy_and_its_perplexity_is_near_float32",
    "curl -s localhost:8731/v1/completions -H 'Content-Type: application/json' -d '{\"model\": "
    '"gpt_tiny_stdlib", "prompt": "def ", "max_tokens": 16, "temperature": 0}\'': "tests/test_quantize.py::test_int8_server_answers_greedy_and_its_perplexity_is_near_float32",
    "python -m engine.evaluate --ckpt checkpoints/gpt_tiny_stdlib": "tests/test_evaluate.py::test_same_loss_as_the_trainers_validation_at_other_layouts",
    "python -m engine.evaluate --ckpt checkpoints/gpt_tiny_stdlib --tp-size 2 --dp-size 2": "tests/test_evaluate.py::test_same_loss_as_the_trainers_validation_at_other_layouts",
    "python -m engine.evaluate --ckpt weights/ --text docs/ARCHITECTURE.md": "tests/test_evaluate.py::test_text_file_loss_is_the_mean_cross_entropy_of_its_windows",
    "python -m apps.serve --hf-dir weights-hf/ --port 8741": "tests/test_lm_eval.py::test_lm_eval_loglikelihoods_equal_the_training_loss_and_generations_greedy",
    "HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 lm_eval --model local-completions --model_args "
    "base_url=http://127.0.0.1:8741/v1/completions,model=weights-hf,tokenizer=weights-hf,"
    "tokenizer_backend=huggingface,max_length=256 --tasks meshtron_ll,meshtron_gen "
    "--include_path apps/eval_tasks --log_samples --output_path lm-eval-out/": "tests/test_lm_eval.py::test_lm_eval_loglikelihoods_equal_the_training_loss_and_generations_greedy",
    "python -m studies.eval.lm_eval_check --ckpt weights-hf/ --samples lm-eval-out/": "tests/test_lm_eval.py::test_lm_eval_loglikelihoods_equal_the_training_loss_and_generations_greedy",
    # docs/MODELS.md
    "python -m engine.pretrain model=llama_tiny tp_size=2 name=llama_tiny": "tests/test_engine.py::test_tiny_model_trains_at_tp2_dp2",
    "python -m engine.pretrain model=moe_tiny name=moe_tiny trainer.max_steps=30 tp_size=1": "tests/test_moe_hf.py::test_moe_tiny_trains_and_exports_as_mixtral",
    "python -m engine.pretrain model=moe_tiny name=moe_tiny_tp2 trainer.max_steps=30": "tests/test_moe_tp.py::test_tp2_sequence_parallel_equals_the_unsplit_model_and_its_checkpoint_loads_at_tp1",
    "python tools/convert_hf.py import --hf-dir DIR --out CKPT": "tests/test_hf.py::test_command_line_tools",
    "python tools/verify_equivalence.py --hf-dir DIR --tp-size 4": "tests/test_hf_import_checks.py::test_documented_verifier_command_passes_at_its_default_dtype",
    # docs/PERFMODEL.md
    "python tools/plan.py predict --model gpt_1.3b --global-batch 512 --gpus 16 --tp 2 --cluster dgx_h100 "
    "--json": "tests/test_perfmodel.py::test_plan_predict_json_keys_without_torch",
    "python tools/plan.py search --model llama_70b --seq 4096 --global-batch 256 --gpus 32 --dp-shard full": "tests/test_perfmodel.py::test_search_finds_full_sharding_where_replicas_do_not_fit",
    "python tools/plan.py predict --model llama_70b --seq 4096 --global-batch 256 --gpus 32 --pp 4 --tp 4 "
    "--dp-shard full --schedule interleaved_1f1b --virtual-stages 4 --sequence-parallel": "tests/test_perfmodel.py::test_plan_prices_pipeline_and_sharding_flags_without_torch",
    "python tools/calibrate.py --hidden 128,256 --out configs/cluster/cpu_2core.yaml": "tests/test_perfmodel.py::test_ci_sized_validation_pipeline_runs_here",
    "python tools/validate_perfmodel.py machine --cluster configs/cluster/cpu_2core.yaml": "tests/test_perfmodel.py::test_ci_sized_validation_pipeline_runs_here",
    "python tools/validate_perfmodel.py published": "tests/test_perfmodel.py::test_published_megatron_rows_within_15_percent",
    "python tools/validate_perfmodel.py dp-plots --out docs": "manual: rewrites docs/perfmodel_*.png with matplotlib; no test compares the plots",
    "python tools/bench_serve.py": "manual: the 4-minute benchmark of docs/BENCHMARKS.md; the same path at a tiny size in test_every_request_answered_once_with_the_sequential_tokens",
    "python tools/bench_serve.py --ckpt checkpoints/gpt_tiny_stdlib --clients 32 "
    "--requests 256": "manual: needs the quick start's checkpoint; the same path on a built model in test_every_request_answered_once_with_the_sequential_tokens",
    "python tools/bench_serve.py --clients 4 --requests 8 --batch 4 --hidden 32 --vocab 300 "
    "--positions 128 --prompt-tokens 4 24 --max-tokens 4 8 16": "tests/test_bench_serve.py::test_every_request_answered_once_with_the_sequential_tokens",
}


def _blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", documented_text(), re.S)


def readme_commands_in_order() -> list[str]:
    """Every command line of the README and its pages in reading order, repeats kept: bash
    blocks (comments dropped, ``&&`` chains split) and the ``$ `` lines of text blocks."""
    lines = []
    for kind, block in re.findall(r"```(bash|text)\n(.*?)```", documented_text(), re.S):
        if kind == "bash":
            block = re.sub(" +", " ", block.replace("\\\n", " "))  # join continuations
            lines += block.splitlines()
        else:
            block = re.sub(r" *\\\n *", " ", block)  # join continuations
            lines += [ln[2:] for ln in block.splitlines() if ln[:2] == "$ "]
    commands = []
    for line in lines:
        line = line.split(" #")[0].strip() if not line.startswith("#") else ""
        commands += [part.strip() for part in line.split(" && ") if part.strip()]
    return commands


def readme_commands() -> list[str]:
    """The README's command lines, each once."""
    return list(dict.fromkeys(readme_commands_in_order()))


def test_every_readme_command_is_run_or_mapped_to_a_test():
    commands = readme_commands()
    assert len(commands) >= 20, commands  # the extraction found the README's commands
    unaccounted = [c for c in commands if c not in RUN and c not in COVERED]
    assert not unaccounted, f"README commands neither run nor mapped in COVERED: {unaccounted}"
    stale = [c for c in COVERED if c not in commands]
    assert not stale, f"COVERED lists commands the README no longer has: {stale}"
    for command, where in COVERED.items():
        if where.startswith("manual: "):
            continue
        path, name = where.split("::")
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), (command, where)


def test_install_quick_start_and_tests_come_first():
    """The README opens with the install, the quick start and the test commands, in that
    order, before any other command of it or of its pages."""
    assert readme_commands_in_order()[:5] == [
        "pip install torch==2.13.0",
        'pip install -e ".[dev,hf]"',
        "python -m engine.pretrain",
        "python -m pytest -q -n 2 --dist loadfile",
        'python -m pytest -q -m "not slow"',
    ]
    first_screen = "\n".join(README.splitlines()[:50])
    assert "python -m pytest -q" in first_screen


def _program_args(command: str) -> tuple[str, list[str]] | None:
    """(program, its arguments) of a command that runs engine.pretrain or a tool."""
    argv = shlex.split(command)
    for module in ("engine.pretrain", "engine.evaluate", "apps.serve"):
        if module in argv:
            return module, argv[argv.index(module) + 1 :]
    tools = [a for a in argv if a.startswith("tools/") and a.endswith(".py")]
    if tools:
        return tools[0], argv[argv.index(tools[0]) + 1 :]
    return None


def _hydra_compose(overrides: list[str]) -> None:
    multirun = "-m" in overrides
    overrides = [o for o in overrides if o != "-m"]
    # A sweep (-m key=a,b) runs each value: compose each, one at a time.
    sweeps = [
        [o]
        if not multirun or "," not in o
        else [o.split("=")[0] + "=" + v for v in o.split("=", 1)[1].split(",")]
        for o in overrides
    ]
    runs = [[]]
    for options in sweeps:
        runs = [run + [choice] for run in runs for choice in options]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        for run in runs:
            compose("config", overrides=run)


def _load_tool(path: str):
    name = f"readme_tool_{Path(path).stem}"
    if name not in sys.modules:  # registered first: dataclasses look their module up there
        spec = importlib.util.spec_from_file_location(name, ROOT / path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


@pytest.mark.slow
def test_every_readme_command_parses_with_its_program():
    """Hydra composes every engine.pretrain override set; argparse accepts every tool's
    arguments. Catches a README that names a key, a preset or an option that is gone."""
    parsed = 0
    for command in readme_commands():
        if "…" in command:  # shown abbreviated on purpose; COVERED names the test that runs it
            continue
        found = _program_args(command)
        if found is None:
            continue
        program, args = found
        if program == "engine.pretrain":
            _hydra_compose(args)
        elif program == "engine.evaluate":
            from engine.evaluate import parse_args

            parse_args(args)
        elif program == "apps.serve":
            from apps.serve import parse_args

            parse_args(args)
        else:
            _load_tool(program).parse_args(args)
        parsed += 1
    assert parsed >= 20


def shown_output(command: str) -> str:
    """The lines the README shows under ``$ command`` (continuation lines joined), up to
    the next ``$`` line or the block's end."""
    for block in _blocks("text"):
        lines = re.sub(r" *\\\n *", " ", block).splitlines()  # a command's continuations joined
        if f"$ {command}" in lines:
            rest = lines[lines.index(f"$ {command}") + 1 :]
            end = next((i for i, ln in enumerate(rest) if ln[:2] == "$ "), None)
            return "\n".join(rest[:end]).strip()
    raise AssertionError(f"the README shows no output for {command!r}")


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(RUN))
def test_cheap_readme_commands_run_as_shown(command, tmp_path):
    argv = [str(ROOT / a) if a.startswith("tools/") else a for a in shlex.split(command)]
    argv[0] = sys.executable  # cwd is a temporary directory: the tool is named by full path
    done = subprocess.run(
        argv, capture_output=True, text=True, env=subprocess_env(ROOT), cwd=tmp_path, timeout=120
    )
    got = (done.stdout + done.stderr).strip()
    assert (done.returncode, got) == (RUN[command], shown_output(command)), done.stderr


# Appended to a README snippet: its y against the unsplit computation on the assembled
# weights (each rank adds its shard into zeros; all-reduce, which gloo on CPU or CUDA and
# NCCL all support). fp32; the TP run adds two partial sums of 2048 products where the
# unsplit one adds 4096 in another order: ~1e-6 relative on outputs of order 1, so 1e-5.
_CHECK = """
import torch.distributed as dist
def full(p, dim):
    if dim is None or ps.tp_size == 1:
        return p.detach().clone()
    shape = list(p.shape); n = shape[dim]; shape[dim] *= ps.tp_size
    out = torch.zeros(shape, dtype=p.dtype, device=p.device)
    out.narrow(dim, ps.tp_rank * n, n).copy_(p.detach())
    dist.all_reduce(out, group=ps.tp_group)
    return out
F = torch.nn.functional
w1, b1, w2 = full(fc1.weight, 0), full(fc1.bias, 0), full(fc2.weight, 1)
ref = F.linear(F.gelu(F.linear(x, w1, b1)), w2, fc2.bias.detach())
torch.testing.assert_close(y.detach(), ref, rtol=1e-5, atol=1e-5)
assert fc1.weight.grad is not None and fc2.weight.grad is not None
print(f"snippet ok tp={ps.tp_size} rank={ps.rank}")
"""


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_python_snippets_run_as_shown(ranks, tmp_path):
    blocks = _blocks("python")
    assert blocks, "README.md has no ```python block"
    for i, block in enumerate(blocks):
        script = tmp_path / f"snippet{i}.py"
        check = _CHECK if "ColumnParallelLinear" in block else ""
        script.write_text(block + check)
        launcher = (
            []
            if ranks == 1
            else ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        )
        done = subprocess.run(
            [sys.executable, *launcher, str(script)],
            capture_output=True,
            text=True,
            env=subprocess_env(ROOT),
            cwd=tmp_path,
            timeout=180,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "ImplicitStateWarning" not in done.stderr, done.stderr  # state passed explicitly
        if check:
            # Ranks share the pipe and an unbuffered print writes its newline separately,
            # so two ranks' lines can run together: find the phrases, not the lines.
            oks = sorted(re.findall(r"snippet ok tp=\d+ rank=\d+", done.stdout))
            assert oks == [f"snippet ok tp={ranks} rank={r}" for r in range(ranks)], done.stdout


def _verify_rows(spec) -> list[tuple[str, str, bool]] | None:
    import parallel_state
    from studies.verification.layouts import compare_layouts

    parallel_state.initialize(spec.tp_size, spec.dp_size)
    report = compare_layouts(spec)
    return report and [(row.kind, row.name, row.ok) for row in report.rows]


@pytest.mark.slow
def test_the_verifiers_shown_output_is_what_it_prints():
    """The README's verifier table lists rows the tool really reports, in its order, and its
    last line counts them: run the README's layout (gpt, tp=2 dp=2, sequence parallel,
    selective recompute) on 4 gloo ranks. The errors themselves (1e-16 noise) are not
    compared; every shown row must say ok."""
    from studies.verification.layouts import VerifySpec

    spec = VerifySpec(
        model="gpt", tp_size=2, dp_size=2, sequence_parallel=True, recompute="selective"
    )
    rows = run_ranks(_verify_rows, 4, spec, timeout=300)[0]
    block = next(b for b in _blocks("text") if "gpt vs reference, float64" in b)
    shown = [
        [cell.strip() for cell in line.split("│")[1:-1]]
        for line in block.splitlines()
        if line.startswith("│")
    ]
    kinds_names = [(kind, name) for kind, name, *_ in shown if kind != "…"]
    real = iter((kind, name) for kind, name, _ in rows)
    assert all(pair in real for pair in kinds_names), kinds_names  # in order, a subsequence
    assert all(cells[-1] == "ok" for cells in shown if cells[0] != "…")
    assert all(ok for *_, ok in rows)
    assert (
        block.strip().splitlines()[-1] == f"all {len(rows)} tensors within relative tolerance 1e-10"
    )
