"""Time to first token through `quince serve`, cold and from the prompt cache.

Starts the server on a free port, then, with the official OpenAI client and streaming:
1. a fresh conversation of about --prompt-tokens tokens (cold: nothing cached),
2. the same conversation with the reply and one more user turn (its prefix comes from the
   checkpoint the first request wrote),
3. the second request again with the prompt cache off (a server started with
   --no-prompt-cache), the cold baseline for the same prompt.
Prints each TTFT, the cached tokens reported, and the ratio.

Usage: python tests/bench/server_ttft.py --quince target/release/quince --model DIR
  [--prompt-tokens 2000] [--repeats 3]
"""

import argparse
import statistics
import subprocess
import tempfile
import time

import openai

KEY = "qk-bench"


def serve(quince, model, data, *extra):
    server = subprocess.Popen(
        [quince, "serve", "--model", model, "--port", "0", "--api-key", KEY, "--data-dir", data,
         *extra], stdout=subprocess.PIPE, text=True)
    url = server.stdout.readline().strip()
    return server, openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)


def ttft(client, messages):
    started = time.perf_counter()
    first, usage, text = None, None, []
    stream = client.chat.completions.create(
        model="any", messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter() - started
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    return first * 1e3, usage, "".join(text)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quince", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    # About 7 tokens a sentence.
    words = "The quince is a fruit that ripens late in autumn and smells of honey. "
    long = words * max(1, args.prompt_tokens // 14)
    cold, cached, baseline, reused, prompt = [], [], [], 0, 0
    for r in range(args.repeats):
        history = [{"role": "user", "content": f"Notes {r}: {long}\nSummarise them."}]
        with tempfile.TemporaryDirectory() as data:
            server, client = serve(args.quince, args.model, data)
            try:
                ms, usage, reply = ttft(client, history)
                cold.append(ms)
                follow = history + [{"role": "assistant", "content": reply},
                                    {"role": "user", "content": "And in one word?"}]
                ms, usage, _ = ttft(client, follow)
                cached.append(ms)
                reused, prompt = usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens
            finally:
                server.terminate()
                server.wait()
        with tempfile.TemporaryDirectory() as data:
            server, client = serve(args.quince, args.model, data, "--no-prompt-cache")
            try:
                baseline.append(ttft(client, follow)[0])
            finally:
                server.terminate()
                server.wait()
    c, h, b = (statistics.median(x) for x in (cold, cached, baseline))
    print(f"prompt {prompt} tokens, {reused} restored from the prompt cache "
          f"(medians of {args.repeats})")
    print(f"first request, cold          TTFT {c:8.1f} ms")
    print(f"next turn, prompt cache off  TTFT {b:8.1f} ms")
    print(f"next turn, from the cache    TTFT {h:8.1f} ms   ({b / h:.1f}x faster)")


if __name__ == "__main__":
    main()
