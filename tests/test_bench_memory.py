"""`tandem bench memory`: smaps parsing and grouping, the computed model parts, and the host report."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytest

from bench import machine, memory

SMAPS = """\
55d0c0000000-55d0c0001000 r--p 00000000 08:01 123 /root/.pyenv/versions/3.11.7/bin/python3.11
Size:                  4 kB
Rss:                   4 kB
Pss:                   4 kB
Anonymous:             0 kB
VmFlags: rd mr mw me dw sd
55d0c1000000-55d0c9000000 rw-p 00000000 00:00 0                          [heap]
Size:             131072 kB
Rss:              120000 kB
Pss:              120000 kB
Anonymous:        120000 kB
7f0000000000-7f0040000000 rw-p 00000000 00:00 0
Size:            1048576 kB
Rss:             1000000 kB
Pss:             1000000 kB
Anonymous:       1000000 kB
THPeligible:    0
7f1000000000-7f1004000000 r-xp 00000000 08:01 456 /v/site-packages/torch/lib/libtorch_cpu.so
Size:              65536 kB
Rss:               50000 kB
Pss:               25000 kB
Anonymous:             0 kB
7f1004000000-7f1004100000 rw-p 04000000 08:01 456 /v/site-packages/torch/lib/libtorch_cpu.so
Size:               1024 kB
Rss:                 800 kB
Pss:                 800 kB
Anonymous:           600 kB
7f1100000000-7f1100100000 r-xp 00000000 08:01 457 /v/site-packages/torch/lib/libgomp-a34b3233.so.1
Size:               1024 kB
Rss:                 300 kB
Pss:                 150 kB
Anonymous:             0 kB
7f1200000000-7f1200400000 r-xp 00000000 08:01 458 /v/site-packages/xgrammar/xgrammar_bindings.so
Size:               4096 kB
Rss:                2000 kB
Pss:                2000 kB
Anonymous:             0 kB
7f1300000000-7f1300400000 r-xp 00000000 08:01 459 /v/site-packages/tokenizers/tokenizers.abi3.so
Size:               4096 kB
Rss:                4692 kB
Pss:                4692 kB
Anonymous:             0 kB
7f1400000000-7f1400100000 r-xp 00000000 08:01 460 /usr/lib/x86_64-linux-gnu/libc.so.6
Size:               1024 kB
Rss:                1000 kB
Pss:                  50 kB
Anonymous:             0 kB
7f1500000000-7f1500100000 r-xp 00000000 08:01 461 /v/site-packages/pydantic_core/_pydantic_core.so
Size:               1024 kB
Rss:                 700 kB
Pss:                 700 kB
Anonymous:             0 kB
7f1600000000-7f1600100000 r--s 00000000 08:01 462 /models/SmolLM2/model.safetensors
Size:               1024 kB
Rss:                 100 kB
Pss:                 100 kB
Anonymous:             0 kB
7f1700000000-7f1700100000 r--p 00000000 08:01 463 /usr/lib/locale/locale-archive
Size:               1024 kB
Rss:                  20 kB
Pss:                  10 kB
Anonymous:             0 kB
7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0                          [stack]
Size:                132 kB
Rss:                  64 kB
Pss:                  64 kB
Anonymous:            64 kB
ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]
Size:                  4 kB
Rss:                   0 kB
Pss:                   0 kB
Anonymous:             0 kB
"""
TOTAL_RSS_KB = 4 + 120000 + 1000000 + 50000 + 800 + 300 + 2000 + 4692 + 1000 + 700 + 100 + 20 + 64


def test_smaps_is_parsed_per_mapping_with_anonymous_memory_told_apart() -> None:
    mappings = memory.parse_smaps(SMAPS)
    assert len(mappings) == 14
    assert sum(m.rss_kb for m in mappings) == TOTAL_RSS_KB
    heap, unnamed = mappings[1], mappings[2]
    assert (heap.path, heap.rss_kb, heap.anonymous) == ("[heap]", 120000, True)
    assert (unnamed.path, unnamed.size_kb, unnamed.anonymous) == ("", 1048576, True)
    assert not mappings[3].anonymous and mappings[3].pss_kb == 25000
    assert mappings[-2].anonymous and not mappings[-1].anonymous  # [stack] is, [vsyscall] is not


@pytest.mark.parametrize(
    ("path", "family"),
    [
        ("/venv/lib/python3.11/site-packages/torch/lib/libtorch_python.so", "torch"),
        ("/venv/lib/python3.11/site-packages/torch/lib/libc10.so", "torch"),
        ("/venv/lib/python3.11/site-packages/torch/lib/libgomp-a34b3233.so.1", "oneDNN / MKL / OpenMP"),
        ("/opt/intel/lib/libmkl_core.so.2", "oneDNN / MKL / OpenMP"),
        ("/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0", "python"),
        (
            "/root/.pyenv/versions/3.11.7/lib/python3.11/lib-dynload/_ssl.cpython-311-x86_64-linux-gnu.so",
            "python",
        ),
        ("/venv/lib/python3.11/site-packages/grpc/_cython/cygrpc.cpython-311-x86_64-linux-gnu.so", "gRPC"),
        ("/venv/lib/python3.11/site-packages/tokenizers/tokenizers.abi3.so", "tokenizers"),
        ("/venv/lib/python3.11/site-packages/numpy.libs/libscipy_openblas64_-ff651d7f.so", "numpy"),
        ("/root/.cache/torch_extensions/py311_cpu/tandem_cpu/tandem_cpu.so", "tandem C++ kernels"),
        ("/root/.cache/tandem/tools/llama.cpp/lib/libggml-cpu.so", "llama.cpp / ggml"),
        ("/root/.cache/tandem/tools/llama.cpp/models/SmolLM2-135M-Instruct.Q8_0.gguf", "model files (mmap)"),
        ("/usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.30", memory.SYSTEM_LIBRARIES),
        ("/venv/lib/python3.11/site-packages/tvm_ffi/lib/libtvm_ffi.so", memory.OTHER_SO),
        ("/tmp/some-file (deleted)", memory.OTHER_FILES),
    ],
)
def test_file_backed_mappings_are_grouped_by_library_family(path: str, family: str) -> None:
    assert memory.family_of(path) == family


def test_the_rows_sum_to_the_measured_rss_with_the_model_parts_counted_out_of_anonymous_memory() -> None:
    mappings = memory.parse_smaps(SMAPS)
    weights, kv = 200 * 2**20, 700 * 2**20
    found = memory.account(mappings, {"weights": weights, "KV pool": kv})
    rows = dict(found["rows"])
    assert found["rss_bytes"] == TOTAL_RSS_KB * 1024
    assert sum(size for _, size in found["rows"]) == found["rss_bytes"]
    assert found["anonymous_bytes"] == (120000 + 1000000 + 64) * 1024
    assert rows["weights"] == weights and rows["KV pool"] == kv
    assert rows[memory.OTHER_ANONYMOUS] == found["anonymous_bytes"] - weights - kv
    assert rows["torch"] == 50800 * 1024 and rows["oneDNN / MKL / OpenMP"] == 300 * 1024
    assert rows["xgrammar"] == 2000 * 1024 and rows["tokenizers"] == 4692 * 1024
    assert rows["python"] == 4 * 1024 and rows[memory.OTHER_SO] == 700 * 1024
    assert rows["model files (mmap)"] == 100 * 1024 and rows[memory.OTHER_FILES] == 20 * 1024
    assert found["pss_bytes"] < found["rss_bytes"]
    assert found["anonymous_split_bytes"] == {
        "brk heap": 120000 * 1024,
        "anonymous mmap": 1000000 * 1024,
        "stacks": 64 * 1024,
    }
    # Parts larger than the anonymous memory are cut to it: the rows still sum to the RSS.
    capped = memory.account(mappings, {"weights": 10 * 2**30, "KV pool": kv})
    assert dict(capped["rows"])["KV pool"] == 0 and dict(capped["rows"])[memory.OTHER_ANONYMOUS] == 0
    assert sum(size for _, size in capped["rows"]) == capped["rss_bytes"]


def test_int8_weights_are_a_byte_a_weight_plus_fp32_row_scales_and_a_tied_head_counts_once() -> None:
    shapes = {
        "model.embed_tokens.weight": [100, 8],
        "model.layers.0.self_attn.q_proj.weight": [8, 8],
        "model.layers.0.input_layernorm.weight": [8],
        "lm_head.weight": [100, 8],
    }
    assert memory.weight_bytes(shapes, "int8", tied=True) == (800 + 400) + (64 + 32) + 32
    assert memory.weight_bytes(shapes, "int8", tied=False) == 2 * (800 + 400) + (64 + 32) + 32
    assert memory.weight_bytes(shapes, "none", tied=True) == (800 + 64 + 8) * 4


def test_the_engine_ready_line_and_the_engine_core_pid_are_read_from_the_json_log() -> None:
    log = "\n".join(
        [
            "not json",
            '{"message": "engine core process started (pid 4242)", "level": "INFO"}',
            '{"message": "engine ready", "num_blocks": 2048, "block_size": 16, "kv_dtype": "torch.float32"}',
        ]
    )
    found = memory.engine_ready(log)
    assert found["engine_core_pid"] == 4242
    assert (found["num_blocks"], found["block_size"], found["kv_dtype"]) == (2048, 16, "torch.float32")


def test_this_process_is_found_as_a_child_of_its_parent() -> None:
    assert os.getpid() in memory.children_of(os.getppid())
    own = memory.parse_smaps(open(f"/proc/{os.getpid()}/smaps").read())
    assert memory.account(own)["rss_bytes"] > 0


def test_cpu_flags_come_from_the_flags_line_under_either_vnni_spelling() -> None:
    text = "processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu sse avx2 avx512f avx512vnni amx_tile\n"
    assert machine.cpu_flags(text) == {
        "avx2": True,
        "avx512f": True,
        "avx512bw": False,
        "avx512_vnni": True,
        "avx512_bf16": False,
        "amx_tile": True,
        "amx_int8": False,
    }
    assert not any(machine.cpu_flags("").values())


def test_host_label_names_cpu_cores_instruction_set_and_bandwidth_and_tolerates_old_documents() -> None:
    flags = dict.fromkeys(machine.KERNEL_FLAGS, False) | {"avx2": True, "avx512f": True, "avx512_vnni": True}
    info = {
        "cpu": "AMD EPYC 7B13",
        "cores": 2,
        "cpu_flags": flags,
        "memory_bandwidth_gbs": {"single_thread": 20.1, "all_threads": 32.7, "threads": 2},
    }
    assert machine.host_label(info) == "AMD EPYC 7B13, 2 cores, avx512 vnni, 32.7 GB/s"
    info["cpu_flags"] = dict.fromkeys(machine.KERNEL_FLAGS, False) | {"avx2": True}
    assert machine.host_label(info) == "AMD EPYC 7B13, 2 cores, avx2, 32.7 GB/s"
    # A neighbour on a shared host drags the all-thread copy below one thread's: the better one is named.
    info["memory_bandwidth_gbs"] = {"single_thread": 22.0, "all_threads": 16.8, "threads": 2}
    assert machine.host_label(info).endswith(", 22.0 GB/s")
    assert machine.host_label({"cpu": "Xeon", "cores": 2}) == "Xeon, 2 cores"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_machine_info_has_the_cpu_flags_and_a_probed_bandwidth() -> None:
    info = machine.machine_info()
    assert set(info["cpu_flags"]) == set(machine.KERNEL_FLAGS)
    assert all(isinstance(value, bool) for value in info["cpu_flags"].values())
    bandwidth = info["memory_bandwidth_gbs"]
    assert bandwidth["single_thread"] > 0 and bandwidth["all_threads"] > 0 and bandwidth["threads"] >= 1
    assert machine.machine_info(probe_bandwidth=False)["memory_bandwidth_gbs"] is None
    assert f"{info['cores']} cores" in machine.host_label(info)


@pytest.mark.slow
@pytest.mark.real_model
def test_bench_memory_accounts_for_a_real_server(real_model_dir: Path) -> None:
    """One real int8 server, a small KV pool (4 slots of 256 tokens, sized by the flags' default): each
    process's rows sum to its RSS, the engine core holds the computed weights and KV pool, the front
    door holds neither."""
    parser = argparse.ArgumentParser()
    memory.add_arguments(parser)
    args = parser.parse_args(
        ["--tokens", "1024", "--slots", "4", "--threads", "1", "--settle", "0.5", "--no-malloc-trim",
         "--no-llama-server"]
    )  # fmt: skip
    run = memory.measure_tandem(args, real_model_dir)
    assert {"front door", "engine core"} <= set(run["processes"])
    assert run["kv_pool_tokens"] == 1024
    for process in run["processes"].values():
        idle = process["idle"]
        assert sum(size for _, size in idle["rows"]) == idle["rss_bytes"]
    core = dict(run["processes"]["engine core"]["idle"]["rows"])
    assert any(
        name.startswith("weights") and size == run["computed_bytes"]["weights"] for name, size in core.items()
    )
    front = dict(run["processes"]["front door"]["idle"]["rows"])
    assert not any(name.startswith(("weights", "KV pool")) for name in front)
