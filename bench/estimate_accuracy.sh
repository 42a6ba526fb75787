#!/usr/bin/env bash
# `batchinfer estimate` against the job it predicts (issue 32, scenario 2): a 100-line calibration job
# through `batchinfer run`, then one `batchinfer worker`, `estimate --json` on 150 other lines of the same
# kind (chat, greedy, max_tokens 96, SmolLM2), the job submitted and timed (in_progress_at..completed_at).
# Prints both and the errors. Usage: bash bench/estimate_accuracy.sh [WORKDIR]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
B="$ROOT/.venv/bin/batchinfer"
PY="$ROOT/.venv/bin/python"
WORK="${1:-$(mktemp -d)}"
export BATCHINFER_DATA_DIR="$WORK/data"
rm -rf "$BATCHINFER_DATA_DIR"; mkdir -p "$WORK"; cd "$WORK"
"$PY" - <<'PY'
import json
topics = ["the ocean", "a city at night", "bread baking", "a chess opening", "volcanoes", "the moon", "a bicycle",
          "coffee", "winter", "a lighthouse", "honey bees", "trains", "a library", "rain", "mountains", "tea",
          "a garden", "clocks", "bridges", "whales", "deserts", "jazz", "paper", "snow", "forests"]
asks = ["Write one sentence about {}.", "Give three facts about {}.", "Describe {} in a short paragraph.",
        "Name two things people like about {}.", "Write a haiku about {}."]
def write(path, n, offset):
    with open(path, "w") as f:
        for i in range(n):
            prompt = asks[(i * 7 + offset) % len(asks)].format(topics[(i + offset) % len(topics)])
            f.write(json.dumps({"custom_id": f"r{offset}-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": "smollm2-135m-instruct", "max_tokens": 96, "temperature": 0,
                                         "messages": [{"role": "user", "content": prompt}]}}) + "\n")
write("cal.jsonl", 100, 0)
write("next.jsonl", 150, 3)
PY
"$B" run cal.jsonl -o cal-out.jsonl >/dev/null 2>&1
"$B" worker > worker.log 2>&1 &
WPID=$!
trap 'kill $WPID 2>/dev/null || true' EXIT
for _ in $(seq 1 60); do sleep 1; "$B" workers --json | grep -q live && break; done
"$B" estimate next.jsonl --json > estimate.json
ID=$("$B" submit -q --result-cache off next.jsonl)
# Poll every 2 s: each `status` is a process of its own, and a tighter loop takes CPU from the worker.
for _ in $(seq 1 300); do
  sleep 2; "$B" status "$ID" --json > status.json; grep -q '"status": *"completed"' status.json && break
done
"$PY" - <<'PY'
import json
e, s = json.load(open("estimate.json")), json.load(open("status.json"))
seconds, tokens = s["completed_at"] - s["in_progress_at"], s["usage"]["output_tokens"]
print(f"estimate: expected_seconds {e['expected_seconds']}, expected_output_tokens {e['expected_output_tokens']}")
print(f"actual:   seconds {seconds} (whole seconds), output tokens {tokens}")
print(f"errors:   seconds {100 * (e['expected_seconds'] - seconds) / seconds:+.1f}%, "
      f"tokens {100 * (e['expected_output_tokens'] - tokens) / tokens:+.1f}%")
PY
