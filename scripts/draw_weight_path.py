# python scripts/draw_weight_path.py docs/weight_path.png
"""Draw the weight path of docs/architecture.md: a trainer's weights through chatgen.param_sync's shared pieces
and one of its three transports into a generation module. Rerun after changing the transports."""

import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

BOXES = {  # name: (x, y, width, label)
    "trainer": (
        0.2,
        4.6,
        2.6,
        "trainer\nMegatronModule.hf_weights()\nnn.Module / (name, tensor) pairs",
    ),
    "source": (3.4, 4.6, 2.4, "source.py\nweight_source(x):\nplan, buckets(), reference(i)"),
    "checks": (
        6.4,
        4.6,
        3.0,
        "checks.py\nmanifest, header, finiteness,\nfingerprints, MAC / signature,\nload_into",
    ),
    "local": (0.6, 2.4, 2.6, "local.py\nLocalSender\n(same process)"),
    "group": (3.7, 2.4, 2.6, "group.py\nGroupSender / GroupReceiver\n(1 + N ranks, any nodes)"),
    "shm": (6.8, 2.4, 2.6, "shm.py\nShmSender / ShmReceiver\n(/dev/shm, handshake passed in)"),
    "wire": (6.8, 0.4, 2.6, "wire.py\nrendezvous, deadlines,\nJSON, token challenge"),
    "engine": (
        3.7,
        0.4,
        2.6,
        "generation module\nweight_manifest(), load_weights(),\nneeds_resync",
    ),
}
ARROWS = [
    ("trainer", "source"),
    ("source", "checks"),
    ("source", "local"),
    ("source", "group"),
    ("source", "shm"),
    ("group", "wire"),
    ("shm", "wire"),
    ("local", "engine"),
    ("group", "engine"),
    ("shm", "engine"),
]
HEIGHT = 1.2


def centre(name, side):
    x, y, w, _ = BOXES[name]
    return {
        "top": (x + w / 2, y + HEIGHT),
        "bottom": (x + w / 2, y),
        "left": (x, y + HEIGHT / 2),
        "right": (x + w, y + HEIGHT / 2),
    }[side]


def main(out: str) -> None:
    fig, ax = plt.subplots(figsize=(10, 6.4))
    for name, (x, y, w, label) in BOXES.items():
        colour = "#dbe9f6" if name in ("local", "group", "shm") else "#f2f2f2"
        ax.add_patch(
            FancyBboxPatch((x, y), w, HEIGHT, boxstyle="round,pad=0.05", fc=colour, ec="#333333")
        )
        ax.text(x + w / 2, y + HEIGHT / 2, label, ha="center", va="center", fontsize=8.5)
    for a, b in ARROWS:
        (ax_, ay, _, _), (bx, by, _, _) = BOXES[a], BOXES[b]
        if abs(ay - by) < 0.5:
            start, end = centre(a, "right"), centre(b, "left")
        else:
            start, end = (
                centre(a, "bottom" if ay > by else "top"),
                centre(b, "top" if ay > by else "bottom"),
            )
        ax.annotate("", end, start, arrowprops=dict(arrowstyle="->", color="#333333", lw=1.2))
    ax.text(
        0.2,
        6.15,
        "chatgen.param_sync: a trainer's weights -> one transport -> a generation module",
        fontsize=11,
        weight="bold",
    )
    ax.text(
        0.2,
        0.5,
        "every transport:\nsend(source, validate) on every\ntrainer rank; receive_into(target,\nmode); close()",
        fontsize=8,
        style="italic",
    )
    ax.set_xlim(0, 9.8)
    ax.set_ylim(0, 6.5)
    ax.axis("off")
    fig.savefig(out, dpi=110, bbox_inches="tight")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/weight_path.png")
