import json, sys
d = json.load(open(sys.argv[1]))
for r in d["runs"]:
    c = r.get("counts_after_warmup", {})
    ph = max(c.get("compile_phases", {}).values(), key=len, default={})
    parts = next(iter(c.get("compile_parts", {}).values()), {})
    print("   static_first", c.get("static_first"), "eager_calls", c.get("static_first_eager_calls"), "background", c.get("background"))
    bg = r.get("background_runs") or []
    if bg:
        print("   background_runs", len(bg), "until", r.get("background_until_compiled_s"), "it/s", [round(x.get("it_s") or 0, 1) for x in bg][:12], "last states", bg[-1].get("states"))
    for w in r.get("sweep", []) or []:
        print("   sweep", w.get("width"), w.get("height"), w.get("steps"), w.get("text_len"), "first", round(w.get("first_s", 0), 2), "it/s", round(w.get("it_s") or 0, 2), "new", w.get("new_compiles"), w.get("recompile_reasons", ""))
    for k in ("compiles", "recompiles", "cache_hits", "fallbacks"):
        if k in r: print("   final", k, r.get(k))
    its = [x.get("it_s") for x in r.get("runs", [])]
    print(sys.argv[1].split("/")[-1], "cold=%.1f" % r.get("warmup_s", -1), "it/s=", [round(i, 2) for i in its if i],
          "compiles", c.get("compiles"), "recompiles", c.get("recompiles"), "fallbacks", c.get("fallbacks"),
          "first_call", list((c.get("precompiled_first_call") or {}).values()))
    print("   phases", {k: round(v, 1) for k, v in ph.items()})
    if "dynamo_trace" in ph:
        print("   dynamo_trace", round(ph["dynamo_trace"], 2))
    for e in parts.get("each") or []:
        print("   part", e["part"], e.get("where"), "nodes", e["nodes"], "cost", e.get("cost"), "at", e.get("at_s"), "compile_s", e.get("compile_s"),
              "aot", e.get("phases_s", {}).get("create_aot_dispatcher_function"), "fw", e.get("phases_s", {}).get("compile_fx.<locals>.fw_compiler_base"),
              "codegen", e.get("phases_s", {}).get("GraphLowering.codegen"))
    print("   parts", {k: v for k, v in parts.items() if k not in ("slowest_child", "late_size_guards", "each")}, "slowest",
          {k: v for k, v in (parts.get("slowest_child") or {}).items() if k != "phases_s"})
    print("   warm", r.get("warm_cache_s") or r.get("warmup_with_cache_s") or {k: v for k, v in r.items() if "warm" in k and not isinstance(v, (dict, list))})
    print("   late", parts.get("late_size_guards"), "fallback_reasons", c.get("fallback_reasons"))
