"""The tokenizer process's memory stays bounded however many distinct prompts it encodes: the
tokenizers library's BPE cache (for the built-in tokenizer, one entry per distinct short prompt)
holds at most WORD_CACHE_ENTRIES pieces. Measured in a fresh process, so nothing else moves its RSS."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, random
from shared.config import builtin_model_dir
from tokenizer_proc.requests.tokenizer import TextTokenizer, WORD_CACHE_ENTRIES

tok = TextTokenizer.from_dir(builtin_model_dir())
rng = random.Random(0)
words = [f"w{rng.randrange(10**6)}" for _ in range(5000)]

def rss_kb():
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0])

seen = [rss_kb()]
for _ in range(5):
    for _ in range(WORD_CACHE_ENTRIES):
        tok.encode(" ".join(rng.choice(words) for _ in range(rng.randint(4, 16))))
    seen.append(rss_kb())
print(json.dumps(seen))
"""


def test_encoding_ever_new_prompts_stops_growing_once_the_word_cache_is_full() -> None:
    """After the first WORD_CACHE_ENTRIES distinct prompts, 4x as many more add (almost) nothing; with
    the library's own bound (10,000 entries of a few KB each) each batch added ~6 MB."""
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rss = json.loads(done.stdout.strip().splitlines()[-1])
    later_growth_mb = (rss[-1] - rss[1]) / 1024
    assert later_growth_mb < 2.0, f"RSS per batch of distinct prompts (KB): {rss}"
