import json
import sys

d = json.load(open(sys.argv[1]))
for r in d["runs"]:
    c = r.get("counts_after_warmup", {})
    ph = next(iter(c.get("compile_phases", {}).values()), {})
    parts = next(iter(c.get("compile_parts", {}).values()), {})
    its = [x.get("it_s") for x in r.get("runs", [])]
    print(sys.argv[1].split("/")[-1], "cold=%.1f" % r.get("warmup_s", -1), "it/s=", [round(i, 2) for i in its if i],
          "compiles", c.get("compiles"), "recompiles", c.get("recompiles"), "fallbacks", c.get("fallbacks"))
    print("   phases", {k: round(v, 1) for k, v in ph.items()})
    for e in parts.get("each") or []:
        print("   part", e["part"], e.get("where"), "nodes", e["nodes"], "distinct", e.get("distinct"), "compile_s", e.get("compile_s"),
              "aot", e.get("phases_s", {}).get("create_aot_dispatcher_function"), "fw", e.get("phases_s", {}).get("compile_fx.<locals>.fw_compiler_base"),
              "codegen", e.get("phases_s", {}).get("GraphLowering.codegen"))
    print("   parts", {k: v for k, v in parts.items() if k not in ("slowest_child", "late_size_guards", "each")}, "slowest",
          {k: v for k, v in (parts.get("slowest_child") or {}).items() if k != "phases_s"})
    print("   warm", r.get("warm_cache_s") or r.get("warmup_with_cache_s") or {k: v for k, v in r.items() if "warm" in k and not isinstance(v, (dict, list))})
    print("   late", parts.get("late_size_guards"), "fallback_reasons", c.get("fallback_reasons"))
