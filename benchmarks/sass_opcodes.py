"""Static SASS opcode counts of the built kernels whose demangled name matches a pattern:
where a kernel's instructions go (converts, mma, shared loads, address math), to compare
variants before timing them. Needs cuobjdump and cu++filt (CUDA toolkit; or c++filt) and a JIT build.

    python benchmarks/sass_opcodes.py 'gemv_kernel<__half, 4, 2, 1, 128, true>' ... [--top 30]
"""
import argparse
import collections
import glob
import os
import re
import shutil
import subprocess


def library() -> str:
    cache = os.environ.get("WOQ_CACHE", os.path.expanduser("~/.cache/woq"))
    found = sorted(glob.glob(f"{cache}/torch_extensions/*/*.so"), key=os.path.getmtime)
    if not found:
        raise SystemExit(f"no built kernel library under {cache}/torch_extensions")
    return found[-1]


def functions(sass: str) -> dict[str, list[str]]:
    """Mangled function name -> its SASS lines."""
    out, name = {}, None
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            name = m.group(1)
            out[name] = []
        elif name:
            out[name].append(line)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("patterns", nargs="+", help="substrings of demangled kernel names (template arguments as "
                    "written in C++: 'gemv_kernel<__half, 4, 2, 1, 128, true>'), or mangled names (faster)")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    # mangled names (as in the PTX's .entry lines) are disassembled alone: a whole
    # library's SASS takes cuobjdump about a minute
    by_name = [p for p in a.patterns if p.startswith("_Z")]
    only = ["--function", ",".join(by_name)] if len(by_name) == len(a.patterns) else []
    sass = subprocess.run(["cuobjdump", "--dump-sass", *only, library()], capture_output=True, text=True,
                          check=True).stdout
    funcs = functions(sass)
    demangler = shutil.which("cu++filt") or shutil.which("c++filt") or "cu++filt"
    names = subprocess.run([demangler], input="\n".join(funcs), capture_output=True, text=True,
                           check=True).stdout.splitlines()
    matched = 0
    for mangled, pretty in zip(funcs, names):
        # (cu++filt writes template values with their casts: "(int)4", "(bool)1")
        pretty = re.sub(r"\(bool\)1", "true", re.sub(r"\(bool\)0", "false", re.sub(r"\((?:int|unsigned int)\)", "", pretty)))
        if not any(p in pretty or p == mangled for p in a.patterns):
            continue
        ops = collections.Counter()
        for line in funcs[mangled]:
            m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)", line)
            if m:
                ops[m.group(1)] += 1
        matched += 1
        print(f"{pretty}: {sum(ops.values())} instructions")
        for op, n in ops.most_common(a.top):
            print(f"  {n:6d}  {op}")
    if not matched:
        raise SystemExit(f"none of the {len(funcs)} functions matches; e.g. {names[:3]}")


if __name__ == "__main__":
    main()
