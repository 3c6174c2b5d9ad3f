"""The benchmark's printed report: the ceiling, a row per path timed, and the check, breakdown and prefill profile
when they ran (the same numbers --json writes)."""

from __future__ import annotations


def table(result: dict) -> str:
    bw, ceiling = result["bandwidth"]["read_gbs"], result["ceiling_tok_s"]
    lines = [
        f"{result['model']} on {result['device']} · bf16 · prompt {result['prompt_len']} · "
        f"{result['new_tokens']} new tokens · greedy, batch 1",
        f"read bandwidth (measured now): {bw:,.0f} GB/s (copy {result['bandwidth']['copy_gbs']:,.0f} GB/s) · "
        f"bytes/token {result['bytes_per_token'] / 1e9:.3f} GB · ceiling {ceiling:,.0f} tok/s "
        f"({1e6 / ceiling:.0f} us/token)",
    ]
    if "runner_bytes_per_token" in result:
        read = result["runner_bytes_per_token"]
        lines.append(f"the runner's greedy step reads {read / 1e9:.3f} GB (head screen: + the candidates' rows; "
                     f"packed kinds in 12 bits): {bw * 1e9 / read:,.0f} tok/s for those bytes; % of ceiling "
                     "below is against the bf16 bytes")  # fmt: skip
    if placement := result.get("residual_placement"):
        steps = ", ".join(f"{us:,.1f}" for us in placement["step_us"])
        lines.append(f"the residual kept at candidate {placement['kept']} of {len(placement['step_us'])} "
                     f"(inference/fast/residual_placement.py; greedy step us: {steps})")  # fmt: skip
    lines += [
        "",
        "| path | decode tok/s | us/token | % of ceiling | TTFT ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in result["rows"]:
        if "error" in row:
            lines.append(f"| {row['path']} | failed: {row['error'][:80]} | | | |")
            continue
        ttft = f"{row['ttft_ms']:.1f}" if row.get("ttft_ms") is not None else ""
        paths = ", ".join(f"{path} {n}" for path, n in row.get("sample_paths", {}).items())
        name = row["path"] + (f" · sampler steps: {paths}" if paths else "")
        if "same_tokens_as_full_head" in row:
            name += f" · draws as the full head's: {100 * row['same_tokens_as_full_head']:.1f}%"
        if "left_screen_after" in row:
            name += f" · whole head from step {row['left_screen_after']} (flat logits)"
        lines.append(f"| {name} | {row['tok_s']:,.0f} | {1e6 / row['tok_s']:.0f} | "
                     f"{100 * row['tok_s'] / ceiling:.1f}% | {ttft} |")  # fmt: skip
    if "check" in result:
        c = result["check"]
        if "error" in c:
            lines.append(f"\ncheck failed to run: {c['error']}")
        else:
            decisive = c.get("decisive_fp32_argmax_agree")
            lines.append(
                f"\ncheck ({c['steps']} teacher-forced steps, tokens from the fp32 reference):\n"
                f"  vs the bf16 reference: max rel err {c['max_rel_err']:.2e}, mean {c['mean_rel_err']:.2e}, "
                f"same argmax {100 * c['argmax_agree']:.1f}% -> {'PASS' if c['passed'] else 'FAIL'}\n"
                f"  vs the fp32 reference: max rel err {c['fp32_max_rel_err']:.2e}, mean "
                f"{c['fp32_mean_rel_err']:.2e}, same argmax {100 * c['fp32_argmax_agree']:.1f}% -> "
                f"{'PASS' if c['passed_fp32'] else 'FAIL'}\n"
                f"  the bf16 reference itself vs fp32: max rel err {c['reference_vs_fp32_max_rel_err']:.2e}, same "
                f"argmax {100 * c['reference_vs_fp32_argmax_agree']:.1f}%\n"
                f"  decisive steps (fp32 top-2 margin > the bf16 reference's max logit error): "
                f"{c['decisive_steps']}/{c['steps']}, fast path same argmax as fp32 on them: "
                + (f"{100 * decisive:.1f}%" if decisive is not None else "-")
            )
            if c.get("screen_same_token") is not None:
                lines.append(
                    f"  head screen: the full head's argmax at {100 * c['screen_same_token']:.1f}% of steps"
                )
            if "fp32_margin_median" in c:
                lines.append(
                    f"  fp32 logits ({c['init']} weights): top1-top2 margin median {c['fp32_margin_median']:.3g}, "
                    f"10th pct {c['fp32_margin_p10']:.3g}; skip path (head on the current token's embedding) "
                    f"picks the argmax at {100 * c['skip_path_argmax_agree']:.1f}% of steps; top logit "
                    f"{100 * c['top_logit_norm_share_median']:.2f}% of the squared norm (median)"
                )
    if "breakdown" in result and "kinds" in result["breakdown"]:
        b = result["breakdown"]
        lines += [
            f"\nper kernel (fast path{', one stream' if b.get('one_stream') else ''}, {b['kernels_per_step']} "
            f"kernels/step, step span {b['step_span_us']:.0f} us):",
            "| kernel | per step | us on path | us busy | MB read | GB/s | % of read bw | ideal us |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for kind, k in b["kinds"].items():
            lines.append(
                f"| {kind} | {k['count']} | {k['path_us']:.1f} | {k['busy_us']:.1f} | {k['bytes'] / 1e6:.1f} | "
                f"{k['gbs']:,.0f} | {k['pct_of_read_bw']:.0f}% | {k['ideal_us']:.1f} |"
            )
    if "prefill_profile" in result:
        pp = result["prefill_profile"]
        if "error" in pp:
            lines.append(f"\nprefill profile failed: {pp['error']}")
        else:
            lines.append(f"\nprefill, GPU time by kernel (total {pp['gpu_ms']:.1f} ms):")
            lines += [f"  {k['ms']:7.2f} ms {k['calls']:4d}x {k['name'][:90]}" for k in pp["kernels"]]
            if "timeline_ms" in pp:
                tl = pp["timeline_ms"]
                lines.append(f"  timeline (profiled, host call to first token): {tl['wall']:.1f} ms = "
                             f"{tl['before_first_kernel']:.2f} before the first kernel + GPU busy + "
                             f"{tl['gpu_idle_between']:.2f} idle between kernels + {tl['after_last_kernel']:.2f} "
                             "after the last one")  # fmt: skip
    return "\n".join(lines)
