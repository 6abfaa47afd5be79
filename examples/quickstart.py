"""A few requests through a five-stage pipeline, recorded with the stage-span API into the store.

    .venv/bin/python examples/quickstart.py      # then: .venv/bin/stagetrace trace quickstart-0001

(from the checkout's root; with the venv active, ``python`` and ``stagetrace`` alone do).

The allreduce stage runs on two TP ranks in worker threads that join the request through a
``traceparent`` carrier, as ranks in other processes would.
"""

import os
import random
import shutil
import sys
import threading
import time
from pathlib import Path

import stagetrace

PROMPTS = ["why is the sky blue?", "what is an all-reduce?", "why is the sky blue?"]


def rank_worker(carrier, rank, partial, results):
    with stagetrace.stage(
        "allreduce",
        input=partial,
        parent=carrier,
        rank=rank,
        attributes={"parallel.tp_size": 2, "allreduce.algorithm": "ring"},
    ) as st:
        time.sleep(0.002)
        results[rank] = sum(partial)
        st.set_output(results[rank])


def serve(request_id, prompt, rng):
    model = {"name": "tiny-demo", "weights": "w-2026-12-01"}
    with stagetrace.request(
        request_id,
        input={"prompt": prompt, "model": model, "seed": 7, "temperature": 0.0},
        attributes={"gen_ai.request.model": model["name"], "gen_ai.request.seed": 7},
    ) as req:
        with stagetrace.stage(
            "retrieval", input=prompt, attributes={"retrieval.top_k": 3, "retrieval.index.version": "v1"}
        ) as st:
            time.sleep(0.003 + rng.random() / 1000)
            docs = sorted({sum(map(ord, w)) % 97 for w in prompt.split()})[:3]
            st.set_output(docs)
            st.set_attribute("retrieval.doc_ids", docs)
        with stagetrace.stage("cache", input=docs, attributes={"cache.hit": False}) as st:
            st.set_output(docs)
        with stagetrace.stage(
            "context_assembly", input=[prompt, docs], attributes={"context.template.version": "t3"}
        ) as st:
            context = f"{docs}:{prompt}"
            st.set_attributes({"context.tokens": len(context.split()), "context.truncated": False})
            st.set_output(context)
        results = {}
        halves = [[float(len(context)), 1.0], [2.0, 3.0]]
        ranks = [threading.Thread(target=rank_worker, args=(req.carrier(), r, halves[r], results)) for r in (0, 1)]
        for t in ranks:
            t.start()
        for t in ranks:
            t.join()
        with stagetrace.stage(
            "decode",
            input=[context, results[0] + results[1]],
            attributes={"gpu.uuid": "GPU-00000000-demo", "decode.batch_size": 1},
        ) as st:
            time.sleep(0.004)
            text = f"answer({context})"
            st.set_attributes({"decode.tokens": len(text.split())})
            st.set_output(text)
        req.set_output(text)


def main(argv):
    n = int(argv[1]) if len(argv) > 1 else len(PROMPTS)
    stagetrace.configure(service_name="quickstart")
    rng = random.Random(1)
    ids = [f"quickstart-{i + 1:04d}" for i in range(n)]
    for request_id, i in zip(ids, range(n)):
        serve(request_id, PROMPTS[i % len(PROMPTS)], rng)
    stagetrace.shutdown()
    print(f"recorded {n} requests: {', '.join(ids)}")
    print(f"look one up:  {command()} trace {ids[0]}")


def command() -> str:
    """The stagetrace command beside this Python, as it can be pasted: ``stagetrace`` when the venv is active."""
    beside = Path(sys.executable).with_name("stagetrace")
    on_path = shutil.which("stagetrace")
    if on_path and Path(on_path).resolve() == beside.resolve():
        return "stagetrace"
    return os.path.relpath(beside) if beside.is_relative_to(Path.cwd()) else str(beside)


if __name__ == "__main__":
    main(sys.argv)
