"""hpcdl's thread and library choices, each in its own process beside the default.

oneDNN on/off, inter-op 1 vs 2, intra-op 1 vs all cores, batch 16 vs 32, the convolutions' weight
gradient that tuning.conv_weight_grad = "auto" does not take here: each variant in its own
process (oneDNN and the pools are fixed when TensorFlow loads), its steps interleaved with the
default configuration's, reported as a ratio to it.
"""

from __future__ import annotations

from bench.harness import Bench, BenchError, Probe, best, gf, log, median, mem_available_gb


TUNING_VARIANTS = (
    ("onednn_off", "oneDNN off (Eigen)", ["--onednn", "0"]),
    ("inter1", "inter-op 1", ["--inter", "1"]),
    ("intra1", "intra-op 1", ["--intra", "1"]),
)


def weight_grad_variant() -> tuple[str, str, list[str]]:
    """The convolutions' weight gradient that tuning.conv_weight_grad = "auto" does not take here."""
    from hpcdl.config import TuningConfig
    from hpcdl.engine.tuning import plan_conv_weight_grad, read_cpuinfo

    mine, _ = plan_conv_weight_grad(TuningConfig(), read_cpuinfo())
    other = "tensorflow" if mine == "gemm" else "gemm"
    return "weight_grad", f"conv weight gradient {other} (auto: {mine})", ["--conv-weight-grad", other]


def run(b: Bench) -> None:
    batch = b.args.tuning_batch
    rounds = b.args.rounds
    tf = b.tf_probe()
    res = b.data.setdefault("tuning", {"batch": batch})
    tf.ask(op="setup", batches=[batch], precisions=["float32"])
    # batch 16 vs 32 in the default process
    if b.data.get("step", {}).get("step_flops"):
        small = []
        for _ in range(rounds):
            st = tf.ask(op="step", batch=batch, precision="float32", n=1)
            small.extend(st["flops"] / s for s in st["seconds"])
            big = tf.ask(op="step", batch=b.args.batch, precision="float32", n=1)
            b.data["step"]["step_flops"].extend(big["flops"] / s for s in big["seconds"])
        res["batch_small"] = small
        ref = best(b.data["step"]["step_flops"])
        b.row(f"tuning.batch{batch}", "tuning", f"batch {batch} instead of {b.args.batch}", gf(best(small)),
              f"{best(small) / ref:.2f}x default", f"median {gf(median(small))}", number=best(small) / ref)
    for key, label, extra in TUNING_VARIANTS + (weight_grad_variant(),):
        if mem_available_gb() < 3.0:
            b.row(f"tuning.{key}", "tuning", label, "skipped", "", f"only {mem_available_gb():.1f} GB free")
            continue
        log(f"tuning: {label}: starting its process")
        try:
            probe = Probe(f"tf-{key}", ["--role", "tf", "--image", "224", *extra], b.logdir)
        except BenchError as exc:
            b.row(f"tuning.{key}", "tuning", label, "failed", "", str(exc)[:80])
            continue
        try:
            probe.ask(op="setup", batches=[batch], precisions=["float32"])
            mine, ref, share_mine, share_ref = [], [], [], []
            for r in range(rounds):
                pair = [(probe, mine, share_mine), (tf, ref, share_ref)]
                for p, into, shares in (pair if r % 2 == 0 else pair[::-1]):
                    st = p.ask(op="step", batch=batch, precision="float32", n=1)
                    into.extend(st["flops"] / s for s in st["seconds"])
                    shares.extend(st["cpu_share"])
            res[key] = {"variant": mine, "default": ref, "info": probe.info,
                        "cpu_share_variant": share_mine, "cpu_share_default": share_ref}
            b.row(f"tuning.{key}", "tuning", f"{label} (intra {probe.info['intra_op']}, inter "
                  f"{probe.info['inter_op']}), batch {batch}", gf(best(mine)),
                  f"{best(mine) / best(ref):.2f}x default",
                  f"default {gf(best(ref))} alongside; median ratio {median(mine) / median(ref):.2f}; "
                  f"CPU share {median(share_mine):.0%} vs {median(share_ref):.0%}",
                  number=best(mine) / best(ref))
        finally:
            probe.close()

