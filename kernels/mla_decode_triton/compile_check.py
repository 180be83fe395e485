"""Compile the decode kernels for a Hopper GPU (sm_90) on a machine without one, and inspect the result.

The Triton interpreter checks what the kernels compute but not whether they compile for a GPU: the
interpreter accepts dot shapes, layouts and shared-memory sizes that the compiler would reject, and it
says nothing about register spills or whether the cache loads are pipelined.  Triton can compile
ahead of time for a named target with the ptxas it ships, so this module builds exactly the launches
`mla_decode` would make (same arguments through `plan_launches`, same launch config from
`choose_config`), specialises them the way the JIT does at launch (integer arguments equal to 1
become constants, pointers and integers divisible by 16 get that hint), compiles them for sm_90, and
reports shared memory, registers, spills (stack frame, local loads/stores in the SASS), tensor-core
instructions and asynchronous copies (cp.async, i.e. software-pipelined cache loads).

Run with the interpreter off (the kernels must be real JIT functions):
    TRITON_INTERPRET=0 python -m mla_decode_triton.compile_check [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mla_decode_triton.inputs import check_decode_inputs
from mla_decode_triton.launcher import INTERPRETED, DecodeConfig, choose_config, plan_launches

HOPPER = GPUTarget("cuda", 90, 32)
POINTER_TAGS = {
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.float32: "*fp32",
    torch.int32: "*i32",
    torch.int64: "*i64",
}
# (R, D, heads, page size, cache dtype): the shapes the project decodes, plus the awkward ones.
CASES = [
    (512, 64, 16, 64, torch.bfloat16),
    (512, 64, 128, 64, torch.float16),
    (128, 64, 9, 16, torch.bfloat16),
    (128, 64, 64, 16, torch.bfloat16),  # 64 rows per program, 8 warps
    (64, 32, 9, 16, torch.bfloat16),
    (32, 16, 9, 16, torch.bfloat16),
    (100, 12, 3, 1, torch.float32),
]


@dataclass
class CompileReport:
    case: str
    kernel: str
    config: str
    shared_bytes: int
    registers: int | None
    stack_bytes: int | None
    local_memory_ops: int  # LDL + STL in the SASS: register spills
    tensor_core_ops: int  # HMMA + HGMMA
    async_copies: int  # LDGSTS (cp.async): pipelined global -> shared loads


def _specialise(kernel, args: list, constexprs: dict) -> ASTSource:
    """Signature, constants and alignment hints as the JIT would derive them from these arguments."""
    names = kernel.arg_names
    signature, constants, attrs = {}, {}, {}
    positional = dict(zip(names, args))
    for index, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
            constants[(index,)] = constexprs[name]
            continue
        value = positional[name]
        if isinstance(value, torch.Tensor):
            signature[name] = POINTER_TAGS[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"unexpected kernel argument {name}={value!r}")
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1:
            signature[name] = "constexpr"
            constants[(index,)] = 1
        else:
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    return ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)


def _inspect_cubin(cubin: bytes) -> tuple[int | None, int | None, str]:
    """Registers and stack frame (cuobjdump resource usage) and the SASS, via Triton's own cuobjdump."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None, None, ""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        usage = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "--dump-sass", path], capture_output=True, text=True).stdout
    registers = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    return (int(registers.group(1)) if registers else None, int(stack.group(1)) if stack else None, sass)


def check_case(rank: int, rope_dim: int, heads: int, page_size: int, dtype: torch.dtype,
               num_splits: int = 4, config: DecodeConfig | None = None) -> list[CompileReport]:
    """Compile the split and merge launches of one decode shape for sm_90 and report on each."""
    batch, context = 2, 4 * 64
    pages = context // page_size
    q_latent = torch.zeros((batch, heads, rank), dtype=dtype)
    q_rope = torch.zeros((batch, heads, rope_dim), dtype=dtype)
    kv_cache = torch.zeros((batch * pages, page_size, rank + rope_dim), dtype=dtype)
    page_table = torch.arange(batch * pages, dtype=torch.int32).reshape(batch, pages)  # (batch, pages)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    shape = check_decode_inputs(q_latent, q_rope, kv_cache, page_table, seq_lens, None)
    if config is None:
        config = choose_config(shape, dtype, torch.device("cpu"), num_splits)
    launches, _, _ = plan_launches(q_latent, q_rope, kv_cache, page_table, seq_lens, 0.1, shape, config, dtype)
    label = f"{rank}+{rope_dim} x{heads} page {page_size} {str(dtype).removeprefix('torch.')}"
    reports = []
    for launch in launches:
        source = _specialise(launch.kernel, launch.args, launch.constexprs)
        compiled = triton.compile(
            source, target=HOPPER, options={"num_warps": launch.num_warps, "num_stages": launch.num_stages}
        )
        registers, stack, sass = _inspect_cubin(compiled.asm["cubin"])
        reports.append(
            CompileReport(
                case=label,
                kernel=launch.kernel.fn.__name__,
                config=" ".join(f"{key}={value}" for key, value in launch.constexprs.items() if key.startswith("BLOCK"))
                + f" warps={launch.num_warps} stages={launch.num_stages}",
                shared_bytes=int(compiled.metadata.shared),
                registers=registers,
                stack_bytes=stack,
                local_memory_ops=len(re.findall(r"\b(?:LDL|STL)\b", sass)),
                tensor_core_ops=len(re.findall(r"\b(?:HMMA|HGMMA)\b", sass)),
                async_copies=len(re.findall(r"\bLDGSTS\b", sass)),
            )
        )
    return reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the reports as JSON")
    args = parser.parse_args(argv)
    if INTERPRETED:
        print("compile_check: TRITON_INTERPRET=1 is set; run with TRITON_INTERPRET=0", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence Triton 3.9's default-change warning
    reports = [report for case in CASES for report in check_case(*case)]
    if args.json:
        print(json.dumps([asdict(report) for report in reports]))
    else:
        for report in reports:
            print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
