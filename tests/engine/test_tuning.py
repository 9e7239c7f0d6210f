"""The thread plan: pure functions, no TensorFlow."""

from __future__ import annotations

import pytest

from hpcdl.errors import JobError
from hpcdl.config import TuningConfig
from hpcdl.jobfile import load_job
from hpcdl.process.launch import slurm_cpus_per_task
from hpcdl.engine.tuning import (
    CpuInfo,
    ThreadPlan,
    capped_cpu,
    cgroup_cpu_quota,
    cores_per_rank,
    openblas_coretype,
    parse_cgroup_quota,
    parse_cpuinfo,
    plan_for_this_process,
    plan_threads,
    precision_refusal,
    read_cpuinfo,
    usable_cores,
)

SPR_FLAGS = ("fpu sse sse2 ssse3 sse4_1 sse4_2 avx fma avx2 avx512f avx512dq avx512cd avx512bw "
             "avx512vl avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8")
CPUINFO = f"""processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: {SPR_FLAGS}

processor\t: 1
model name\t: something else
flags\t\t: fpu
"""
# The flags line of the 2-core AMD EPYC (KVM) the bench ran on: AVX2 and FMA, no AVX-512, no bf16.
EPYC_AVX2_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid extd_apicid tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand hypervisor lahf_lm cmp_legacy cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw topoext vmmcall fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid rdseed adx smap clflushopt clwb sha_ni xsaveopt xsavec xgetbv1 xsaves clzero xsaveerptr arat umip vaes vpclmulqdq rdpid fsrm
"""
# Zen 4: AVX-512 with AVX512_BF16, no AMX.
ZEN4_FLAGS = "fpu sse sse2 avx fma avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 avx512_vnni"
EPYC_AVX2 = parse_cpuinfo(EPYC_AVX2_CPUINFO)
SKX = CpuInfo("Skylake", frozenset("avx2 fma avx512f avx512dq avx512cd avx512bw avx512vl".split()))
HSW = CpuInfo("Haswell", frozenset("avx avx2 fma".split()))
OLD = CpuInfo("old", frozenset("sse sse2".split()))


# -- the CPU ---------------------------------------------------------------------------------


def test_parse_cpuinfo_takes_the_first_processor():
    cpu = parse_cpuinfo(CPUINFO)
    assert cpu.model == "Intel(R) Xeon(R) Platinum 8480+"
    assert "amx_bf16" in cpu.flags and "fpu" in cpu.flags and len(cpu.flags) == len(SPR_FLAGS.split())
    assert cpu.bf16 and cpu.bf16_flags == ("avx512_bf16", "amx_bf16")
    assert cpu.vector_isa == "amx"


def test_parse_cpuinfo_arm_and_empty():
    arm = parse_cpuinfo("processor\t: 0\nFeatures\t: fp asimd bf16\nCPU part\t: 0xd0c\n")
    assert arm.model == "unknown" and "asimd" in arm.flags and not arm.bf16
    assert parse_cpuinfo("") == CpuInfo()
    assert read_cpuinfo("/nonexistent/cpuinfo") == CpuInfo()


@pytest.mark.parametrize("cpu, isa, bf16", [(SKX, "avx512", False), (HSW, "avx2", False), (OLD, "sse", False),
                                            (CpuInfo("cpx", SKX.flags | {"avx512_bf16"}), "avx512", True)])
def test_vector_isa_and_bf16(cpu, isa, bf16):
    assert cpu.vector_isa == isa and cpu.bf16 is bf16


@pytest.mark.parametrize("text, isa, unit", [
    (EPYC_AVX2_CPUINFO, "avx2", "none"),  # the bench once called this one's bfloat16 "AVX512_BF16"
    (f"model name\t: AMD EPYC 9654\nflags\t\t: {ZEN4_FLAGS}\n", "avx512", "AVX512_BF16"),
    (CPUINFO, "amx", "AMX"),  # Sapphire Rapids has both; AMX is the one oneDNN uses
    ("processor\t: 0\nFeatures\t: fp asimd bf16 sve\n", None, "none"),  # Grace: no x86 unit
])
def test_bf16_unit_is_named_from_the_flags(text, isa, unit):
    cpu = parse_cpuinfo(text)
    assert (cpu.bf16_unit, cpu.bf16) == (unit, unit != "none")
    if isa:
        assert cpu.vector_isa == isa


def test_mixed_bfloat16_is_refused_without_a_bfloat16_unit():
    refusal = precision_refusal(TuningConfig(precision="mixed_bfloat16"), EPYC_AVX2)
    assert refusal == ("tuning.precision = mixed_bfloat16 needs native bfloat16 (AVX512_BF16 or AMX), "
                       "and this CPU (AMD EPYC, avx2) has neither: use float32")
    assert precision_refusal(TuningConfig(precision="mixed_bfloat16"), SPR) is None
    assert precision_refusal(TuningConfig(precision="float32"), EPYC_AVX2) is None
    # the fpmath mode keeps a float32 model and falls back to float32 instead (test_precision)
    assert precision_refusal(TuningConfig(precision="bfloat16"), EPYC_AVX2) is None
    plan = plan_threads(TuningConfig(precision="mixed_bfloat16"), 2, "x", cpu=EPYC_AVX2)
    assert plan.precision == "float32" and plan.why("precision").startswith("refused: ")
    native = plan_threads(TuningConfig(precision="mixed_bfloat16"), 2, "x", cpu=SPR)
    assert native.precision == "mixed_bfloat16" and "bfloat16 unit: AMX" in native.why("precision")
    # mixed precision is Keras' policy in the model, not oneDNN's fpmath mode
    assert native.environment()["ONEDNN_DEFAULT_FPMATH_MODE"] == "STRICT"


def test_openblas_coretype():
    assert openblas_coretype(parse_cpuinfo(CPUINFO)) == "Cooperlake"
    assert openblas_coretype(SKX) == "SkylakeX"
    assert openblas_coretype(HSW) == "Haswell"
    assert openblas_coretype(OLD) is None


# -- cores -----------------------------------------------------------------------------------


@pytest.mark.parametrize("text, cpus", [("max 100000\n", None), ("200000 100000\n", 2.0),
                                        ("150000 100000", 1.5), ("50000", 0.5), ("garbage", None)])
def test_cgroup_v2_quota(text, cpus):
    assert parse_cgroup_quota(cpu_max=text) == cpus


def test_cgroup_v1_quota_and_files(tmp_path):
    assert parse_cgroup_quota(cfs_quota_us="-1", cfs_period_us="100000") is None
    assert parse_cgroup_quota(cfs_quota_us="400000\n", cfs_period_us="100000\n") == 4.0
    assert parse_cgroup_quota() is None
    (tmp_path / "cpu.max").write_text("300000 100000\n")
    assert cgroup_cpu_quota(tmp_path) == 3.0
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("200000")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert cgroup_cpu_quota(v1) == 2.0
    assert cgroup_cpu_quota(tmp_path / "missing") is None


@pytest.mark.parametrize("affinity, quota, expected", [(8, None, 8), (8, 4.0, 4), (8, 2.5, 2), (8, 0.5, 1),
                                                       (2, 16.0, 2), (0, None, 1)])
def test_usable_cores(affinity, quota, expected):
    assert usable_cores(affinity, quota) == expected


def test_usable_cores_of_this_process_is_positive():
    assert usable_cores() >= 1


@pytest.mark.parametrize("usable, ranks, expected", [(2, 1, 2), (2, 2, 1), (68, 4, 17), (8, 3, 2), (2, 4, 1)])
def test_cores_shared_evenly_by_the_ranks_on_a_host(usable, ranks, expected):
    cores, why = cores_per_rank(None, usable, ranks)
    assert cores == expected
    assert f"{usable} usable cores / {ranks} rank(s)" in why
    assert ("oversubscribed" in why) == (ranks > usable)


def test_the_cpus_a_scheduler_gives_a_task_win_over_the_hosts_share():
    assert cores_per_rank(16, 16, ranks_on_host=4) == (16, "16 CPUs per task")
    # capped by what the process may use (a mask narrower than the request)
    cores, why = cores_per_rank(16, 8, ranks_on_host=1)
    assert cores == 8 and "only 8" in why
    # none given (the local backend, even inside an allocation): the share of the host
    assert cores_per_rank(None, 8, ranks_on_host=2)[0] == 4


def test_slurm_cpus_per_task_is_read_by_the_launch_side_only():
    assert slurm_cpus_per_task({"SLURM_CPUS_PER_TASK": "16"}) == 16
    for value in ("", "0", "x", " "):  # unset, empty, zero or junk: none
        assert slurm_cpus_per_task({"SLURM_CPUS_PER_TASK": value}) is None
    assert slurm_cpus_per_task({}) is None


# -- the plan --------------------------------------------------------------------------------


def test_default_plan_intra_is_the_cores_inter_is_two():
    plan = plan_threads(TuningConfig(), 17, "68 usable cores / 4 rank(s) on this host")
    assert (plan.cores, plan.intra_op, plan.inter_op, plan.onednn, plan.precision) == (17, 17, 2, True, "float32")
    assert plan.why("intra_op") == "cores this rank owns: 68 usable cores / 4 rank(s) on this host"
    assert plan.why("inter_op").startswith("2 when a rank owns >= 2 cores")
    assert plan.why("onednn").startswith("default: tuning.onednn = true")


def test_one_core_gets_one_inter_op_thread():
    plan = plan_threads(TuningConfig(), 1, "2 usable cores / 4 rank(s) on this host")
    assert (plan.intra_op, plan.inter_op) == (1, 1)


def test_job_overrides_win_and_say_so():
    tuning = TuningConfig(intra_op_threads=4, inter_op_threads=1, onednn=False, kmp_blocktime=1)
    plan = plan_threads(tuning, 2, "2 usable cores / 1 rank(s) on this host")
    assert (plan.intra_op, plan.inter_op, plan.onednn, plan.kmp_blocktime) == (4, 1, False, 1)
    assert plan.why("intra_op") == "job: tuning.intra_op_threads = 4 (more than the 2 core(s) this rank owns: oversubscribed)"
    assert plan.why("inter_op") == "job: tuning.inter_op_threads = 1"
    assert plan.why("onednn") == "job: tuning.onednn = false (Eigen kernels)"


def test_environment_before_tensorflow_loads(monkeypatch):
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    plan = plan_threads(TuningConfig(kmp_blocktime=3), 6, "x")
    env = plan.environment()
    assert env == {
        "OMP_NUM_THREADS": "6", "KMP_BLOCKTIME": "3", "KMP_AFFINITY": "granularity=fine,compact,1,0",
        "TF_ENABLE_ONEDNN_OPTS": "1", "TF_NUM_INTRAOP_THREADS": "6", "TF_NUM_INTEROP_THREADS": "2",
        "TF_SET_ONEDNN_FPMATH_MODE": "", "ONEDNN_DEFAULT_FPMATH_MODE": "STRICT",
        "TF_CPP_MIN_LOG_LEVEL": "1",
    }
    off = plan_threads(TuningConfig(onednn=False), 6, "x").environment()
    assert off["TF_ENABLE_ONEDNN_OPTS"] == "0"
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "3")
    assert plan.environment()["TF_CPP_MIN_LOG_LEVEL"] == "3"  # the user's choice is kept


def test_affinity_pinning_off_when_ranks_share_a_mask():
    # 2 local ranks on a 2-CPU mask: compact pinning would put both on CPU 0
    shared = plan_threads(TuningConfig(), 1, "x", ranks_on_host=2, mask=2)
    assert shared.kmp_affinity == "disabled" and "same first cores" in shared.why("kmp_affinity")
    # srun gave each task its own mask: keep the pinning
    own = plan_threads(TuningConfig(), 8, "x", ranks_on_host=4, mask=8)
    assert own.kmp_affinity == "granularity=fine,compact,1,0"
    alone = plan_threads(TuningConfig(kmp_affinity="scatter"), 2, "x", ranks_on_host=1, mask=2)
    assert alone.kmp_affinity == "scatter" and alone.why("kmp_affinity") == "job: tuning.kmp_affinity = scatter"


SPR = parse_cpuinfo(CPUINFO)


@pytest.mark.parametrize("asked, cpu, expected", [
    ("float32", SPR, "float32"),
    ("bfloat16", SPR, "bfloat16"),
    ("bfloat16", SKX, "float32"),  # no native bfloat16: falls back, says why
    ("bfloat16", None, "bfloat16"),  # not checked (e.g. planning on a login node)
])
def test_precision(asked, cpu, expected):
    plan = plan_threads(TuningConfig(precision=asked), 2, "x", cpu=cpu)
    assert plan.precision == expected
    why = plan.why("precision")
    if asked == "bfloat16" and cpu is SKX:
        assert "lacks AVX512_BF16/AMX-BF16" in why
    if expected == "bfloat16" and cpu is not None:
        assert "avx512_bf16, amx_bf16" in why


def test_bfloat16_is_onednn_fpmath_mode():
    env = plan_threads(TuningConfig(precision="bfloat16"), 2, "x", cpu=SPR).environment()
    assert env["TF_SET_ONEDNN_FPMATH_MODE"] == "BF16" and env["ONEDNN_DEFAULT_FPMATH_MODE"] == "BF16"
    # without oneDNN there is no fpmath mode: float32, and the reason says so
    off = plan_threads(TuningConfig(precision="bfloat16", onednn=False), 2, "x", cpu=SPR)
    assert off.precision == "float32" and "tuning.onednn = false" in off.why("precision")
    assert off.environment()["ONEDNN_DEFAULT_FPMATH_MODE"] == "STRICT"
    # on a CPU without bfloat16, float32 and STRICT
    skx = plan_threads(TuningConfig(precision="bfloat16"), 2, "x", cpu=SKX).environment()
    assert skx["ONEDNN_DEFAULT_FPMATH_MODE"] == "STRICT" and skx["TF_SET_ONEDNN_FPMATH_MODE"] == ""


def test_precision_is_validated_in_the_job():
    assert load_job("hep", ["tuning.precision=bfloat16"]).tuning.precision == "bfloat16"
    assert load_job("hep").tuning.precision == "float32"
    assert load_job("hep", ["tuning.precision=mixed_bfloat16"]).tuning.precision == "mixed_bfloat16"
    with pytest.raises(JobError, match="^tuning.precision must be one of float32, bfloat16, mixed_bfloat16; "
                                       "got 'float16'$"):
        load_job("hep", ["tuning.precision=float16"])


def test_default_tuning_derives_inter_op():
    assert TuningConfig().inter_op_threads == 0 and TuningConfig().intra_op_threads == 0


def test_plan_describe_and_reason_name_every_decision():
    plan = plan_threads(TuningConfig(), 2, "2 usable cores / 1 rank(s) on this host", cpu=SPR)
    for key in ("intra_op", "inter_op", "onednn", "precision", "conv_weight_grad", "kmp_affinity"):
        assert f"{key}: " in plan.reason
    assert plan.describe().startswith("threads: intra-op 2, inter-op 2 on 2 core(s); oneDNN on; float32")


def test_plan_for_this_process_reads_the_machine(monkeypatch):
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    plan = plan_for_this_process(TuningConfig(), ranks_on_host=1)
    assert isinstance(plan, ThreadPlan) and plan.intra_op == usable_cores() == plan.cores
    many = plan_for_this_process(TuningConfig(), ranks_on_host=10_000)
    assert many.intra_op == 1 and "oversubscribed" in many.why("intra_op")


# -- the convolutions' weight gradient ---------------------------------------------------------


@pytest.mark.parametrize("cpu, expected", [
    (EPYC_AVX2, "gemm"),  # oneDNN has no brgemm backward-weights kernel for AVX2
    (HSW, "gemm"),
    (SKX, "tensorflow"),
    (SPR, "tensorflow"),
    (OLD, "tensorflow"),  # not measured
    (None, "tensorflow"),  # not checked
])
def test_conv_weight_grad_auto_takes_matmuls_on_avx2_only(cpu, expected):
    plan = plan_threads(TuningConfig(), 2, "x", cpu=cpu)
    assert plan.conv_weight_grad == expected
    assert plan.why("conv_weight_grad").startswith("auto: ")
    assert f"conv weight gradient {expected}" in plan.describe()


def test_conv_weight_grad_job_setting_wins_and_onednn_off_keeps_tensorflow():
    assert plan_threads(TuningConfig(conv_weight_grad="gemm"), 2, "x", cpu=SPR).conv_weight_grad == "gemm"
    forced = plan_threads(TuningConfig(conv_weight_grad="tensorflow"), 2, "x", cpu=EPYC_AVX2)
    assert forced.conv_weight_grad == "tensorflow" and forced.why("conv_weight_grad").startswith("job: ")
    assert plan_threads(TuningConfig(onednn=False), 2, "x", cpu=EPYC_AVX2).conv_weight_grad == "tensorflow"
    with pytest.raises(JobError, match="^tuning.conv_weight_grad must be one of auto, tensorflow, gemm; "
                                       "got 'im2col'$"):
        load_job("hep", ["tuning.conv_weight_grad=im2col"])


def test_onednn_isa_cap_is_the_cpu_every_rule_sees(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    assert read_cpuinfo(path, env={}).vector_isa == "amx"
    avx2 = read_cpuinfo(path, env={"ONEDNN_MAX_CPU_ISA": "avx2"})
    assert avx2.vector_isa == "avx2" and avx2.bf16_unit == "none" and not avx2.bf16
    assert plan_threads(TuningConfig(), 2, "x", cpu=avx2).conv_weight_grad == "gemm"
    assert precision_refusal(TuningConfig(precision="mixed_bfloat16"), avx2) is not None
    assert read_cpuinfo(path, env={"DNNL_MAX_CPU_ISA": "AVX512_CORE_BF16"}).bf16_unit == "AVX512_BF16"
    assert capped_cpu(SPR, "AVX512_CORE").vector_isa == "avx512"
    assert capped_cpu(SPR, "ALL") == SPR and capped_cpu(SPR, "") == SPR


# -- rank layouts (bench/sections/layout.py) -------------------------------------------------


def test_cpulists_and_numa_domains(tmp_path):
    from hpcdl.engine.tuning import numa_domains, parse_cpulist

    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11} and parse_cpulist("") == frozenset()
    for node, cpus in (("node0", "0-3"), ("node1", "4-7"), ("node2", ""), ("node10", "8-11")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus + "\n")
    (tmp_path / "possible").write_text("0-2\n")  # not a node
    assert numa_domains(tmp_path) == [frozenset(range(4)), frozenset(range(4, 8)), frozenset(range(8, 12))]
    assert numa_domains(tmp_path / "missing") == []


def test_rank_layouts():
    from hpcdl.engine.tuning import rank_layouts

    assert rank_layouts([0], [frozenset({0})]) == {"1x1": [[0]]}
    assert rank_layouts([1, 0], []) == {"1x2": [[0, 1]], "2x1": [[0], [1]]}
    four_domains = [frozenset(range(i, i + 16)) for i in range(0, 64, 16)]
    layouts = rank_layouts(list(range(64)), four_domains)
    assert list(layouts) == ["1x64", "2x32", "4x16 (a rank per NUMA domain)"]
    assert layouts["4x16 (a rank per NUMA domain)"][2] == list(range(32, 48))
    # a mask that covers the domains unevenly gets no per-domain layout
    assert list(rank_layouts(list(range(20)), four_domains)) == ["1x20", "2x10"]
