"""The distributed backend under torchrun (4 processes, gloo): a peer that dies makes the others fail
with an error naming it (no hang), the run resumes from the last checkpoint to the result of the
simulation, and checkpoints move between the backends."""
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

import dist_trainer_worker as worker

REPO = pathlib.Path(__file__).resolve().parents[1]
WORKER = pathlib.Path(__file__).resolve().parent / "dist_trainer_worker.py"


def torchrun(*argv, timeout=420):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(WORKER), *map(str, argv)]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.distributed
def test_a_dead_peer_is_named_and_the_run_resumes_from_the_last_checkpoint(tmp_path, ag_news_csv, minilm_path):
    died, resumed = tmp_path / "died", tmp_path / "resumed"
    died.mkdir(), resumed.mkdir()
    proc = torchrun("die", died, ag_news_csv, minilm_path)
    assert proc.returncode == 0, proc.stderr[-5000:]
    reports = {r: json.loads((died / f"report-{r}.json").read_text()) for r in range(4) if r != worker.DYING_RANK}
    assert not (died / f"report-{worker.DYING_RANK}.json").exists()
    # nobody hangs: every survivor stops with one of its directed-ring neighbours named. Which one
    # is a race: the first rank to fail can only have lost rank 2 (everyone else was alive), but
    # its exit can then break a survivor's connection before that survivor noticed rank 2.
    neighbours = {r: {(r - 1) % 4, (r + 1) % 4} for r in range(4)}
    for rank, report in reports.items():
        assert "GossipPeerError" in report["mro"] and report["peer"] in neighbours[rank], (rank, report)
        assert report["step"] in (2, 3) and report["waited_s"] < 10 * worker.GOSSIP_TIMEOUT
    # rank 2's neighbours see it first: at least one names rank 2 and the checkpoint to resume from
    named = [(rank, report) for rank, report in reports.items() if report["peer"] == worker.DYING_RANK]
    assert named, reports
    rank, report = named[0]
    assert f"rank {rank}: gossip step 2:" in report["message"] and "rank 2" in report["message"]
    assert "(in training step 3: the gossip engine counts its steps from 0)" in report["message"]
    # in the words of a Python script and of a recipe
    assert f"resume_from_checkpoint={str(died / 'checkpoint-2')!r} (in a recipe, --resume-from-checkpoint " \
           f"{died / 'checkpoint-2'})" in report["message"]
    assert sorted(p.name for p in died.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-2"]

    proc = torchrun("resume", resumed, ag_news_csv, minilm_path, died / "checkpoint-2")
    assert proc.returncode == 0, proc.stderr[-5000:]
    finals = [torch.load(resumed / f"final-{r}.pt") for r in range(4)]
    assert all(f["step"] == worker.STEPS for f in finals)

    simulated = worker.make_trainer(tmp_path / "sim", "simulated", ag_news_csv, minilm_path)
    simulated.train()
    metrics = simulated.evaluate()
    for rank, final in enumerate(finals):
        sim_state = simulated.nodes[rank].state_dict()
        for key, value in final["model"].items():
            torch.testing.assert_close(value, sim_state[key], rtol=1e-4, atol=1e-5, msg=f"rank {rank}: {key}")
        assert final["bytes_sent"] == int(simulated.bytes_sent[rank])
        torch.testing.assert_close(final["weight"], simulated.gossip.weights[rank:rank + 1], rtol=1e-5, atol=1e-6)
    dist_metrics = finals[0]["metrics"]
    assert dist_metrics["eval_accuracy"] == pytest.approx(metrics["eval_accuracy"], abs=1 / 40)
    assert dist_metrics["eval_consensus_distance"] == pytest.approx(metrics["eval_consensus_distance"], rel=1e-3)
    # every rank's tokens, summed over the ranks, across the checkpoint: the simulated run's count
    assert [f["metrics"]["num_input_tokens_seen"] for f in finals] == [metrics["num_input_tokens_seen"]] * 4
    assert metrics["num_input_tokens_seen"] > worker.STEPS * 4 * 8  # 4 nodes x 8 rows of several tokens per step
    assert [f["total_flos"] for f in finals] == [simulated.state.total_flos] * 4  # Trainer's flos, all nodes

    # both backends write the same state into the same layout: node files hold the same tensors
    from lp_decentral_nlp.trainer import checkpointing as ckpt

    for i in range(4):
        a = ckpt.encode_state(ckpt.load_state_file(died / "checkpoint-2" / ckpt.node_file(i)))
        b = ckpt.encode_state(ckpt.load_state_file(tmp_path / "sim" / "checkpoint-2" / ckpt.node_file(i)))
        assert a[0] == b[0] and a[1].keys() == b[1].keys()  # same structure, same non-tensor state
        for key in a[1]:
            if a[1][key].is_floating_point():
                torch.testing.assert_close(a[1][key], b[1][key], rtol=1e-4, atol=1e-5, equal_nan=True,
                                           msg=f"node {i}: {key}")  # NaN: a log window without a step yet
            else:  # RNG streams, counters, node ids: exact
                assert torch.equal(a[1][key], b[1][key]), f"node {i}: {key}"

    # the distributed checkpoint resumes in the simulated backend, too
    from_dist = worker.make_trainer(tmp_path / "sim2", "simulated", ag_news_csv, minilm_path)
    from_dist.train(resume_from_checkpoint=str(died / "checkpoint-2"))
    for a, b in zip(simulated.nodes, from_dist.nodes):
        for (key, x), y in zip(a.state_dict().items(), b.state_dict().values()):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5, msg=key)
    assert torch.equal(simulated.bytes_sent, from_dist.bytes_sent)


@pytest.mark.distributed
def test_final_merge_gives_every_rank_the_average_of_all_nodes(tmp_path, ag_news_csv, minilm_path):
    """SPEC 2a in the distributed backend: every rank ends with mean_i z_i, bit for bit the model the
    simulated backend's merge gives every node (an all-reduce's order of addition moved the last
    bits of the average: the saved model and its accuracy differed between the backends)."""
    merged = tmp_path / "merged"
    merged.mkdir()
    proc = torchrun("merge", merged, ag_news_csv, minilm_path)
    assert proc.returncode == 0, proc.stderr[-5000:]
    finals = [torch.load(merged / f"final-{r}.pt")["model"] for r in range(4)]
    simulated = worker.make_trainer(tmp_path / "sim", "simulated", ag_news_csv, minilm_path, final_merge=True,
                                    save_strategy="no")
    simulated.train()
    for rank, final in enumerate(finals):
        for key, value in final.items():
            assert torch.equal(value, finals[0][key]), f"rank {rank} differs from rank 0 in {key}"
            assert torch.equal(value, simulated.nodes[rank].state_dict()[key]), f"rank {rank}: {key}"


@pytest.mark.distributed
def test_sigterm_to_one_rank_checkpoints_and_stops_every_rank_at_the_same_step(tmp_path, ag_news_csv, minilm_path):
    """enable_jit_checkpoint: the ranks agree on SIGTERM at the end of each step, so one preempted
    process stops them all after the same step's checkpoint (none hangs waiting for the others)."""
    out = tmp_path / "stopped"
    out.mkdir()
    proc = torchrun("sigterm", out, ag_news_csv, minilm_path)
    assert proc.returncode == 0, proc.stderr[-5000:]
    reports = [json.loads((out / f"report-{rank}.json").read_text()) for rank in range(4)]
    assert reports == [{"step": 1, "stopped": True}] * 4
    # the process that got the signal says so, and one (rank 0, which writes the shared files) where it stopped
    assert proc.stderr.count("SIGTERM received") == 1 and proc.stderr.count("stopped at step 1 on SIGTERM") == 1, \
        proc.stderr[-5000:]
    from lp_decentral_nlp.trainer import checkpointing as ckpt

    assert [step for step, _ in ckpt.list_checkpoints(out)] == [1]


@pytest.mark.distributed
def test_a_damaged_node_file_refuses_the_resume_on_every_rank(tmp_path, ag_news_csv, minilm_path):
    """Each rank reads only its own node files; a damaged one on rank 2 refuses the resume on every
    rank, before any step (the others had trained on until rank 2 was missed)."""
    worker.make_trainer(tmp_path / "sim", "simulated", ag_news_csv, minilm_path, max_steps=2).train()
    node_2 = tmp_path / "sim" / "checkpoint-2" / "node-2.safetensors"
    node_2.write_bytes(node_2.read_bytes()[:1000])
    out = tmp_path / "resumed"
    out.mkdir()
    proc = torchrun("refused", out, ag_news_csv, minilm_path, tmp_path / "sim" / "checkpoint-2")
    assert proc.returncode == 0, proc.stderr[-5000:]
    for rank in range(4):
        report = json.loads((out / f"report-{rank}.json").read_text())
        assert report["error"] == "CheckpointError" and report["step"] == 0 and report["files"] == [], (rank, report)
        assert report["message"].startswith(f"{node_2} is not a readable safetensors file (truncated or corrupted)")


@pytest.mark.distributed
def test_ddp_timeout_bounds_the_waits_outside_the_gossip_step_on_the_cpu(tmp_path):
    """The process group the arguments create takes ddp_timeout on the CPU too (transformers passes
    it on GPUs only): a peer that stalls outside the gossip step (evaluation, checkpoint) is given up
    on after it, not after the default 30 minutes."""
    script = tmp_path / "stall.py"
    script.write_text(textwrap.dedent(f"""
        import time
        import torch.distributed as dist
        from lp_decentral_nlp.trainer import DecentralizedTrainingArguments
        args = DecentralizedTrainingArguments(output_dir={str(tmp_path)!r}, backend="distributed", num_nodes=2,
                                              ddp_timeout=3, use_cpu=True)
        args.device  # sets up the process group
        if dist.get_rank() == 1:
            time.sleep(20)
        start = time.monotonic()
        try:
            dist.barrier()
            print("rank", dist.get_rank(), "passed the barrier", flush=True)
        except RuntimeError:
            print("rank", dist.get_rank(), "gave up after", round(time.monotonic() - start), "s", flush=True)
    """))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script)], env=env, capture_output=True, text=True, timeout=120)
    gave_up = [line for line in proc.stdout.splitlines() if line.startswith("rank 0 gave up after")]
    assert gave_up and int(gave_up[0].split()[-2]) < 10, proc.stdout + proc.stderr[-3000:]


@pytest.mark.distributed
def test_processes_given_other_settings_are_refused_together_before_any_other_collective(tmp_path, ag_news_csv,
                                                                                         minilm_path):
    """One rank given low_precision=False (as --full-precision on one rank of a launch) made the
    initial model's broadcast wait for ddp_timeout (30 minutes) without a word: its model has no
    8-bit buffers, so the ranks' broadcasts did not match."""
    proc = torchrun("disagree", tmp_path, ag_news_csv, minilm_path)
    assert proc.returncode == 0, proc.stderr[-5000:]
    for rank in range(4):
        report = json.loads((tmp_path / f"report-{rank}.json").read_text())
        assert report["error"] == "ValueError", (rank, report)
        assert report["message"] == ("low_precision: rank 2 was given False and rank 0 True: every process of a "
                                     "distributed run must be given the same settings, model and data (launch them "
                                     "with one command)"), report
