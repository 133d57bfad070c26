#!/usr/bin/env python3
"""Two or more training runs' loss curves in one SVG (plain SVG, no plotting library), from the metrics JSONL files
`ringflex train --metrics` writes, plus a text table of the training loss at a few steps.

    python3 bench/trainer/compare_loss.py --svg docs/loss_bf16_vs_f32.svg float32=runs/f32.jsonl bfloat16=runs/bf16.jsonl
"""
import argparse
import json
import math

WIDTH, HEIGHT, MARGIN = 640, 360, 48  # picture and axis margin, pixels
COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]


def read_losses(path):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def svg(runs):
    steps = [s for _, pts in runs for s, _ in pts]
    losses = [v for _, pts in runs for _, v in pts]
    x0, x1 = min(steps), max(steps)
    y0, y1 = 0.0, math.ceil(max(losses))

    def px(s):
        return MARGIN + (s - x0) / max(x1 - x0, 1) * (WIDTH - 2 * MARGIN)

    def py(v):
        return HEIGHT - MARGIN - (v - y0) / (y1 - y0) * (HEIGHT - 2 * MARGIN)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" '
           f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
           f'<line x1="{MARGIN}" y1="{HEIGHT - MARGIN}" x2="{WIDTH - MARGIN}" y2="{HEIGHT - MARGIN}" stroke="black"/>',
           f'<line x1="{MARGIN}" y1="{MARGIN}" x2="{MARGIN}" y2="{HEIGHT - MARGIN}" stroke="black"/>',
           f'<text x="{WIDTH / 2}" y="{HEIGHT - 12}" text-anchor="middle">step</text>',
           f'<text x="14" y="{HEIGHT / 2}" transform="rotate(-90 14 {HEIGHT / 2})" text-anchor="middle">'
           f'training loss</text>']
    for v in range(int(y0), int(y1) + 1):
        out.append(f'<text x="{MARGIN - 6}" y="{py(v) + 4:.1f}" text-anchor="end">{v}</text>')
    for s in (x0, (x0 + x1) // 2, x1):
        out.append(f'<text x="{px(s):.1f}" y="{HEIGHT - MARGIN + 16}" text-anchor="middle">{s}</text>')
    for i, (name, pts) in enumerate(runs):
        colour = COLOURS[i % len(COLOURS)]
        path = " ".join(f"{px(s):.1f},{py(v):.1f}" for s, v in pts)
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.2" points="{path}"/>')
        out.append(f'<text x="{WIDTH - MARGIN - 4}" y="{MARGIN + 16 * i}" text-anchor="end" fill="{colour}">'
                   f'{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="NAME=METRICS.jsonl")
    ap.add_argument("--svg", required=True)
    ap.add_argument("--at", default="1,50,100,150,200,250,300", help="steps for the text table")
    a = ap.parse_args()
    runs = [(spec.split("=", 1)[0], read_losses(spec.split("=", 1)[1])) for spec in a.runs]
    with open(a.svg, "w") as f:
        f.write(svg(runs))
    print("| step | " + " | ".join(name for name, _ in runs) + " |")
    print("|---|" + "---|" * len(runs))
    for s in (int(x) for x in a.at.split(",")):
        vals = [dict(pts).get(s) for _, pts in runs]
        print(f"| {s} | " + " | ".join("-" if v is None else f"{v:.4f}" for v in vals) + " |")


if __name__ == "__main__":
    main()
