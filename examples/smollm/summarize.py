#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Merges smollm's arm results and the llama.cpp peer's into the table, the bar check,
the bench/results/model/ record and the final metrics JSON line of `scripts/measure model`."""
import argparse, datetime, json, sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arms", required=True)
    ap.add_argument("--peer", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--profile", default="full")
    ap.add_argument("--host", default="")
    ap.add_argument("--out")
    a = ap.parse_args()
    r = json.load(open(a.arms))
    peer = json.load(open(a.peer))
    arms = dict(r["arms"])
    arms.update(peer.get("arms", {}))
    dense = arms.get("dense")

    def item_key(it):
        return (it["task"], it["target"], it["index"])

    if dense:  # agreement of the peer arms with dense, same definition as smollm's
        dtok = {item_key(it): it.get("tokens", []) for it in dense["items"]}
        for name, arm in peer.get("arms", {}).items():
            ags = []
            for it in arm["items"]:
                d = dtok.get(item_key(it))
                if d is None or not d:
                    continue
                t = it["tokens"]
                k = 0
                while k < min(len(d), len(t)) and d[k] == t[k]:
                    k += 1
                ags.append(k / max(len(d), len(t)))
            arm["agree64"] = sum(ags) / len(ags) if ags else -1
            arm["ppl_bits_per_scalar"] = arm["bits_per_scalar"]
            arm["ppl_kib_per_token"] = arm["kib_per_token"]

    lengths = sorted({k for arm in arms.values() for k in arm.get("niah", {})}, key=lambda s: int(s[:-1]))
    print()
    print("%-16s %8s %8s %8s %9s" % ("arm", "ppl", "bits", "KiB/tok", "agree64") +
          "".join(" %7s" % ("niah" + L) for L in lengths) + "  prefill tok/s")
    for name, arm in arms.items():
        print("%-16s %8.4f %8.3f %8.2f %9.3f" % (name, arm["ppl"], arm["ppl_bits_per_scalar"],
                                                 arm["ppl_kib_per_token"], arm.get("agree64", -1)) +
              "".join(" %7.3f" % arm["niah"][L]["acc"] if L in arm.get("niah", {}) else "       -" for L in lengths) +
              "  %.0f" % arm.get("prefill_tokens_per_s", 0))

    m = {}
    for name in ("dense", "tiered", "tiered_k4", "tiered_int8r", "fp8", "int8r", "tq3"):
        if name in arms:
            for L in lengths:
                m["niah_acc_%s_%s" % (name, L)] = arms[name]["niah"][L]["acc"]
    m["ppl_dense"] = arms.get("dense", {}).get("ppl")
    m["ppl_tiered"] = arms.get("tiered", {}).get("ppl")
    m["ppl_tiered_int8r"] = arms.get("tiered_int8r", {}).get("ppl")
    m["ppl_tiered_k4"] = arms.get("tiered_k4", {}).get("ppl")
    m["ppl_tq3_only"] = arms.get("tq3", {}).get("ppl")
    m["ppl_fp8"] = arms.get("fp8", {}).get("ppl")
    m["ppl_int8r"] = arms.get("int8r", {}).get("ppl")
    m["ppl_llamacpp_q4_0"] = arms.get("llamacpp_q4_0", {}).get("ppl")
    m["ppl_llamacpp_q8_0"] = arms.get("llamacpp_q8_0", {}).get("ppl")
    # The tiered arms: "tiered" (FP8 recent/anchor tier, the arm), "tiered_int8r"
    # (int8_rotated recent/anchor tier) and "tiered_k4" (that, with TQ4 Stale keys); each gets
    # the bar's metrics under its own suffix.
    tiered_arms = [n for n in ("tiered", "tiered_k4", "tiered_int8r") if n in arms]
    for n in tiered_arms:
        t = arms[n]
        bits = [t["ppl_bits_per_scalar"]] + [v["max_bits_per_scalar"] for L, v in t["niah"].items()
                                              if L in ("4k", "8k")]
        m["bits_per_scalar_" + n] = max(bits)
        m["kib_per_token_" + n] = t["ppl_kib_per_token"]
        m["agree64_" + n] = t["agree64"]
        m["agree_text64_" + n] = t.get("agree_text64")
        if dense:
            right = {item_key(it) for it in dense["items"] if it["score"] == 1.0 and it["target"] in (4096, 8192)}
            lost = [it for it in t["items"] if item_key(it) in right and it["score"] < 1.0]
            m["niah_items_lost_%s_4k_8k" % n] = len(lost)
            m["niah_items_dense_right_4k_8k"] = len(right)
    for name in ("fp8", "int8r", "tq3", "llamacpp_q8_0", "llamacpp_q4_0"):
        if name in arms:
            m["bits_per_scalar_" + name] = arms[name]["ppl_bits_per_scalar"]
            m["agree64_" + name] = arms[name].get("agree64")
    m = {k: v for k, v in m.items() if v is not None}

    print()
    for n in tiered_arms if dense else []:
        ppl, bits = m["ppl_" + n], m["bits_per_scalar_" + n]
        checks = [("%s <= 4.6 bits per scalar" % n, bits <= 4.6),
                  ("%s: no 4K/8K needle item lost vs dense (%d of %d)" % (
                      n, m["niah_items_lost_%s_4k_8k" % n], m["niah_items_dense_right_4k_8k"]),
                   m["niah_items_lost_%s_4k_8k" % n] == 0),
                  ("%s: ppl within 1%% of dense (%+.2f%%)" % (n, 100 * (ppl / m["ppl_dense"] - 1)),
                   ppl <= 1.01 * m["ppl_dense"])]
        if "ppl_llamacpp_q4_0" in m:
            checks.append(("%s: better ppl than llama.cpp q4_0 (%.4f vs %.4f) at fewer bits (%.3f vs 4.5)" %
                           (n, ppl, m["ppl_llamacpp_q4_0"], bits),
                           ppl < m["ppl_llamacpp_q4_0"] and bits < 4.5))
        for text, ok in checks:
            print("bar: %-4s %s" % ("MET" if ok else "MISS", text))
    record = {"name": "model", "date": datetime.datetime.utcnow().strftime("%Y-%m-%dT%H:%M:%SZ"),
              "commit": a.commit, "profile": a.profile, "host": a.host,
              "command": "scripts/measure model" + (" --quick" if a.profile == "quick" else ""),
              "setup": {k: v for k, v in r.items() if k != "arms"},
              "llama_cpp": peer.get("llama_cpp_version", peer.get("skipped")),
              "arms": {k: {kk: vv for kk, vv in v.items() if kk not in ("items", "continuation")}
                       for k, v in arms.items()},
              "items": {k: v.get("items", []) for k, v in arms.items()},
              "metrics": m}
    if a.out:
        json.dump(record, open(a.out, "w"), indent=1)
        print("wrote", a.out)
    print(json.dumps({"name": "model", "metrics": m}, separators=(",", ":")))


if __name__ == "__main__":
    main()
