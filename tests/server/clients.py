"""The official OpenAI and Anthropic Python clients drive `quince serve` (run by `make test`).

Starts the server on a free port with a key, on the trained demo model, then checks:
- chat completions, non-streaming and streaming, equal `quince generate` on the same message
  (greedy), and the streamed deltas join to the same text;
- a raw completion (`/v1/completions`);
- an image sent as a data URL is answered, and a corrupt one is refused with 400;
- a request without the key gets 401 (the client's AuthenticationError), n=2 and a malformed
  body get 400 with OpenAI's error shape;
- a second request that extends the first reports cached prompt tokens;
- Anthropic's messages, non-streaming and streaming (the SDK's own event parser), equal the same
  reply, and its client's errors arrive typed;
- `response_format` json_schema replies validate against their schema (`jsonschema`), streamed
  or not, and json_object replies parse;
- a tool-call round trip with each client: a reply that must call a tool (the demo's template
  has no tools, so they go in as a system prompt and the call is held to the tool's schema)
  returns a call whose arguments validate, streamed as `tool_calls` deltas too; the tool's
  result sent back is rendered into the next prompt, which the model answers.

Usage: python tests/server/clients.py --quince target/debug/quince --model target/demo-model
"""

import argparse
import base64
import json
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import anthropic
import jsonschema
import openai

KEY = "qk-test-clients"
ROOT = Path(__file__).resolve().parents[2]
IMAGE = ROOT / "tests/golden/vision/images/rgb_640x480.png"


def check(condition, what):
    if not condition:
        raise AssertionError(what)
    print(f"ok: {what.split(':')[0]}")


def generate(quince, model, prompt, max_tokens):
    out = subprocess.run(
        [quince, "generate", "--model", model, "--prompt", prompt,
         "--max-tokens", str(max_tokens), "--json"],
        check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["text"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quince", required=True)
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as data:
        server = subprocess.Popen(
            [args.quince, "serve", "--model", args.model, "--port", "0", "--api-key", KEY,
             "--data-dir", data],
            stdout=subprocess.PIPE, text=True)
        try:
            base_url = server.stdout.readline().strip()
            if not base_url.startswith("http://127.0.0.1:"):
                raise AssertionError(f"the server did not start: {base_url!r}")
            run(args, base_url)
        finally:
            server.terminate()
            server.wait(timeout=30)
    print("server clients: passed")


def run(args, base_url):
    client = openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0)
    prompt = "What is a quince?"
    want = generate(args.quince, args.model, prompt, 24)

    models = client.models.list()
    check(len(models.data) == 1, f"one model listed: {models}")

    reply = client.chat.completions.create(
        model=models.data[0].id, messages=[{"role": "user", "content": prompt}],
        max_tokens=24, temperature=0)
    text = reply.choices[0].message.content
    check(text == want, f"non-streaming equals quince generate: {text!r} vs {want!r}")
    check(0 < reply.usage.completion_tokens <= 24 and reply.usage.prompt_tokens > 0,
          f"usage counts the tokens: {reply.usage}")

    stream = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": prompt}], max_tokens=24,
        temperature=0, stream=True, stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    check("".join(pieces) == want, f"streamed deltas join to the same reply: {pieces!r}")
    check(usage is not None and usage.prompt_tokens_details.cached_tokens > 0,
          f"the same prompt again is served from the prompt cache: {usage}")

    follow = client.chat.completions.create(
        model="any", max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": prompt}, {"role": "assistant", "content": want},
                  {"role": "user", "content": "Where does it grow?"}])
    cached = follow.usage.prompt_tokens_details.cached_tokens
    check(cached >= reply.usage.prompt_tokens,
          f"a request that extends the first reuses its prompt: {cached} cached")

    raw = client.completions.create(model="any", prompt="Once upon a time", max_tokens=6,
                                    temperature=0)
    check(raw.choices[0].finish_reason == "length" and raw.usage.completion_tokens == 6,
          f"a raw completion runs to max_tokens: {raw}")

    image = base64.b64encode(IMAGE.read_bytes()).decode()
    seen = client.chat.completions.create(
        model="any", max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}}]}])
    check(seen.usage.prompt_tokens > reply.usage.prompt_tokens + 60,
          f"an image adds its soft tokens to the prompt: {seen.usage}")
    try:
        client.chat.completions.create(
            model="any", max_tokens=4,
            messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm9wZQ=="}}]}])
        raise AssertionError("a corrupt image was accepted")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and e.code == "invalid_image", f"a corrupt image: {e}")

    try:
        openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
        raise AssertionError("a wrong key was accepted")
    except openai.AuthenticationError as e:
        check(e.status_code == 401, f"401 without the key: {e}")
    try:
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": "x"}],
                                       n=2)
        raise AssertionError("n=2 was accepted")
    except openai.BadRequestError as e:
        check("n must be 1" in e.message, f"400 for n=2: {e}")
    request = urllib.request.Request(
        f"{base_url}/chat/completions", data=b'{"messages": [', method="POST",
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    try:
        urllib.request.urlopen(request)
        raise AssertionError("a malformed body was accepted")
    except urllib.error.HTTPError as e:
        body = json.loads(e.read())
        check(e.code == 400 and set(body["error"]) >= {"message", "type", "code"},
              f"400 with OpenAI's error shape for a malformed body: {body}")

    claude = anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key=KEY,
                                 max_retries=0)
    # This client version no longer takes `temperature` as an argument; the API still does.
    message = claude.messages.create(
        model="any", max_tokens=24, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": prompt}])
    check(message.content[0].text == want
          and message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
              reply.choices[0].finish_reason],
          f"Anthropic's messages equal quince generate: {message}")
    with claude.messages.stream(model="any", max_tokens=24, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": prompt}]) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    check(streamed == want and final.usage.output_tokens == reply.usage.completion_tokens,
          f"Anthropic's stream carries the same reply: {streamed!r}")
    word = max(want.split(), key=len)
    stopped = claude.messages.create(
        model="any", max_tokens=24, extra_body={"temperature": 0},
        stop_sequences=["qqqq", word], messages=[{"role": "user", "content": prompt}])
    check(stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
          and stopped.content[0].text == want[:want.index(word)],
          f"the stop sequence that ended a reply is named: {stopped}")
    try:
        anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key="wrong",
                            max_retries=0).messages.create(
            model="any", max_tokens=4, messages=[{"role": "user", "content": "x"}])
        raise AssertionError("a wrong key was accepted by /v1/messages")
    except anthropic.AuthenticationError as e:
        check(e.status_code == 401, f"Anthropic's client sees 401: {e}")

    structured(client)
    tool_round_trip(client, claude)


# Bounded values: the demo's weights are untrained, so free strings would run to max_tokens.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Oslo", "Lima", "Pune"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days", "metric"],
    "additionalProperties": False,
}


def structured(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    reply = client.chat.completions.create(
        model="any", max_tokens=64, temperature=0, response_format=fmt,
        messages=[{"role": "user", "content": "The weather in Oslo, as JSON."}])
    value = json.loads(reply.choices[0].message.content)
    jsonschema.validate(value, WEATHER)
    check(reply.choices[0].finish_reason == "stop",
          f"a json_schema reply validates against its schema: {value}")
    stream = client.chat.completions.create(
        model="any", max_tokens=64, temperature=0.8, seed=7, response_format=fmt, stream=True,
        messages=[{"role": "user", "content": "Another city."}])
    value = json.loads("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    jsonschema.validate(value, WEATHER)
    check(True, f"a sampled, streamed json_schema reply validates too: {value}")
    reply = client.chat.completions.create(
        model="any", max_tokens=48, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Any JSON object."}])
    text = reply.choices[0].message.content
    check(text.startswith("{") and (reply.choices[0].finish_reason == "length"
                                    or isinstance(json.loads(text), dict)),
          f"a json_object reply is an object: {text!r}")
    try:
        client.chat.completions.create(
            model="any", max_tokens=4, response_format={"type": "json_schema"},
            messages=[{"role": "user", "content": "x"}])
        raise AssertionError("a json_schema format without a schema was accepted")
    except openai.BadRequestError as e:
        check(e.status_code == 400, f"400 for a json_schema without its schema: {e}")


def tool_round_trip(client, claude):
    tools = [{"type": "function", "function": {
        "name": "weather", "description": "The forecast for a city.", "parameters": WEATHER}}]
    question = {"role": "user", "content": "What is the weather in Oslo?"}
    first = client.chat.completions.create(
        model="any", max_tokens=64, temperature=0, tools=tools, tool_choice="required",
        messages=[question])
    choice = first.choices[0]
    calls = choice.message.tool_calls
    check(choice.finish_reason == "tool_calls" and len(calls) == 1
          and calls[0].function.name == "weather",
          f"a reply that must call a tool returns the call: {choice}")
    arguments = json.loads(calls[0].function.arguments)
    jsonschema.validate(arguments, WEATHER)
    check(True, f"the call's arguments validate against the tool's schema: {arguments}")

    stream = client.chat.completions.create(
        model="any", max_tokens=64, temperature=0, tools=tools, tool_choice="required",
        messages=[question], stream=True)
    deltas, finish = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.tool_calls:
            deltas.extend(chunk.choices[0].delta.tool_calls)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    check(finish == "tool_calls" and len(deltas) == 1
          and json.loads(deltas[0].function.arguments) == arguments,
          f"the same call streams as a tool_calls delta: {deltas}")

    result = {"role": "tool", "tool_call_id": calls[0].id,
              "content": json.dumps({"forecast": "sunny", "high_c": 21})}
    history = [question, {"role": "assistant", "content": None,
                          "tool_calls": [c.model_dump() for c in calls]}, result]
    second = client.chat.completions.create(model="any", max_tokens=8, temperature=0,
                                            tools=tools, messages=history)
    without = client.chat.completions.create(model="any", max_tokens=8, temperature=0,
                                             tools=tools, messages=history[:2] + [
                                                 {**result, "content": "{}"}])
    grew = second.usage.prompt_tokens - without.usage.prompt_tokens
    check(second.choices[0].message.content is not None and grew > 5,
          f"the tool's result is rendered into the next prompt ({grew} tokens more than an "
          f"empty result) and answered: {second.choices[0].message.content!r}")

    anthropic_tools = [{"name": "weather", "description": "The forecast for a city.",
                        "input_schema": WEATHER}]
    message = claude.messages.create(
        model="any", max_tokens=64, extra_body={"temperature": 0}, tools=anthropic_tools,
        tool_choice={"type": "any"}, messages=[question])
    uses = [b for b in message.content if b.type == "tool_use"]
    check(message.stop_reason == "tool_use" and len(uses) == 1 and uses[0].input == arguments,
          f"Anthropic's client gets the same call as a tool_use block: {message.content}")
    with claude.messages.stream(
            model="any", max_tokens=64, extra_body={"temperature": 0}, tools=anthropic_tools,
            tool_choice={"type": "tool", "name": "weather"}, messages=[question]) as stream:
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    check(final.stop_reason == "tool_use" and streamed and streamed[0].input == arguments,
          f"and streamed (input_json_delta): {final.content}")
    answer = claude.messages.create(
        model="any", max_tokens=8, extra_body={"temperature": 0}, tools=anthropic_tools,
        messages=[question, {"role": "assistant", "content": [u.model_dump() for u in uses]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                "content": result["content"]}]}])
    check(answer.content and answer.content[0].type == "text"
          and answer.usage.input_tokens + answer.usage.cache_read_input_tokens
          == second.usage.prompt_tokens,
          f"a tool_result block is rendered as the OpenAI tool message is: {answer.usage}")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        sys.exit(1)
