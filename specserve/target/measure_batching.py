"""Measure one padded forward pass for many sessions against a loop of per-session passes.

Not a test (speed belongs to the benchmark harness): a small script whose
numbers the target's design notes quote. Random weights, a Llama of the demo
target's shape by default (d=384, 6 layers, vocab 8192), float32 on CPU (or
``--device cuda``). Every session holds a cache of a different length and
verifies ``gamma`` proposed tokens (``gamma + 1`` positions fed).

    python -m specserve.target.measure_batching --batch 1 4 8 --gamma 4

Both paths include what a verify call pays: the padded path packs the caches,
runs one pass and splits the new KV back; the loop runs each session's own
cache (``SessionCache.extend``) and crops the branch.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _model(hidden: int, layers: int, vocab: int, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=4096,
    )
    return LlamaForCausalLM(config).eval().to(device)


def main() -> None:
    from specserve.engine import batching
    from specserve.engine.kvcache import SessionCache

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    model = _model(args.hidden, args.layers, args.vocab, args.device)
    gen = torch.Generator().manual_seed(1)
    print(f"model d={args.hidden} layers={args.layers} vocab={args.vocab} gamma={args.gamma} {args.device}")
    print("batch  past_lens              loop_ms  padded_ms  padded/loop")
    for batch in args.batch:
        past_lens = [64 + 37 * i for i in range(batch)]
        caches = []
        for n in past_lens:
            cache = SessionCache(model, f"s{n}")
            cache.reconcile(torch.randint(0, args.vocab, (n + 1,), generator=gen).tolist(), pending=True)
            caches.append(cache)
        proposals = [torch.randint(0, args.vocab, (args.gamma + 1,), generator=gen).tolist() for _ in caches]

        def loop(caches=caches, proposals=proposals) -> None:
            for cache, feed in zip(caches, proposals, strict=True):
                cache.extend(feed)
                cache.rollback()

        def padded(caches=caches, proposals=proposals) -> None:
            rows = [
                batching.RowInput(past=tuple(c.layer_kv()), past_len=c.seq_len, input_ids=tuple(f))
                for c, f in zip(caches, proposals, strict=True)
            ]
            packed = batching.pack(rows, config=model.config, device=args.device)
            _logits, grown = batching.forward(model, packed)
            for b, (cache, feed) in enumerate(zip(caches, proposals, strict=True)):
                cache.append_kv(batching.new_kv(grown, packed, b), feed)
                cache.rollback()

        # Samples alternate between the two paths, so a busy machine slows both alike.
        samples: dict[str, list[float]] = {"loop": [], "padded": []}
        loop()
        padded()  # warm-up
        for _ in range(args.repeats):
            for name, fn in (("loop", loop), ("padded", padded)):
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                start = time.perf_counter()
                fn()
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                samples[name].append(time.perf_counter() - start)
        timings = {name: statistics.median(values) * 1e3 for name, values in samples.items()}
        ratio = timings["padded"] / timings["loop"]
        print(
            f"{batch:5d}  {past_lens!s:22.22} {timings['loop']:8.2f} {timings['padded']:10.2f}  {ratio:10.2f}"
        )


if __name__ == "__main__":
    main()
