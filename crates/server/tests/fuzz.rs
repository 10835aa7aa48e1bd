//! Fuzzed request bodies against the running server: random bytes and near-valid JSON (odd
//! roles, content of every type, out-of-range numbers, token ids past the vocabulary, tools,
//! tool calls and results, output formats whose schemas compile or not) on every route. Each gets an answer — 200, or 400/413/503 in the API's error shape — never a 500 or
//! a dropped connection, and the server answers normally afterwards.
#![allow(clippy::unwrap_used)] // test code: a failing unwrap is a failing test

use std::sync::OnceLock;

use proptest::prelude::*;
use serde_json::{Value, json};

const KEY: &str = "fuzz-key";

struct Live {
    runtime: tokio::runtime::Runtime,
    base: String,
    _dir: tempfile::TempDir,
}

fn live() -> &'static Live {
    static LIVE: OnceLock<Live> = OnceLock::new();
    LIVE.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let base = runtime.block_on(async {
            let model = test_support::demo_model(&dir.path().join("demo"));
            let chat = chat::Chat::open(dir.path().join("data")).await.unwrap().with_hf_cache(None);
            chat.load_model(&model, |_| {}).await.unwrap();
            let options = server::ServeOptions {
                port: 0,
                max_body_bytes: 16 << 10,
                ..server::ServeOptions::new(KEY)
            };
            let server = server::Server::start(chat, options).await.unwrap();
            let base = server.base_url();
            // The server runs for the whole test binary.
            std::mem::forget(server);
            base
        });
        Live { runtime, base, _dir: dir }
    })
}

fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        Just(json!(1e300)),
        Just(json!(-0.5)),
        "[a-z <>{}\\\\\"]{0,12}".prop_map(Value::from),
    ]
}

fn part() -> impl Strategy<Value = Value> {
    let kind = prop_oneof![
        Just("text"),
        Just("image_url"),
        Just("image"),
        Just("input_audio"),
        Just("tool_use"),
        Just("tool_result"),
        Just("")
    ];
    (kind, scalar(), scalar()).prop_map(|(kind, a, b)| {
        json!({ "type": kind, "text": a, "image_url": { "url": b.clone() },
                "source": { "type": "base64", "data": b.clone() },
                "id": a.clone(), "name": a.clone(), "input": b.clone(),
                "tool_use_id": a, "content": b })
    })
}

fn content() -> impl Strategy<Value = Value> {
    prop_oneof![
        scalar(),
        prop::collection::vec(part(), 0..3).prop_map(Value::from),
        Just(
            json!([{ "type": "image_url", "image_url": { "url": "data:image/png;base64,AAAA" } }])
        ),
    ]
}

fn message() -> impl Strategy<Value = Value> {
    let role = prop_oneof![
        Just(json!("user")),
        Just(json!("assistant")),
        Just(json!("system")),
        Just(json!("tool")),
        Just(json!("")),
        scalar()
    ];
    let calls = prop_oneof![
        Just(Value::Null),
        Just(json!([{ "id": "c", "type": "function",
                      "function": { "name": "f", "arguments": "{\"x\": 1}" } }])),
        Just(json!([{ "function": { "name": "f", "arguments": "{bad" } }])),
        Just(json!([{}])),
        scalar()
    ];
    (role, content(), calls).prop_map(|(role, content, calls)| {
        let mut message = json!({ "role": role, "content": content });
        if !calls.is_null() {
            message["tool_calls"] = calls;
            message["tool_call_id"] = json!("c");
        }
        message
    })
}

/// Tools of both APIs, well formed or not; schemas the grammar engine takes or refuses.
fn tools() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        Just(json!([{ "type": "function", "function": { "name": "f", "parameters": {
            "type": "object", "properties": { "x": { "enum": [1, 2] } }, "required": ["x"],
            "additionalProperties": false } } }])),
        Just(json!([{ "name": "f", "input_schema": { "type": "object" } }])),
        Just(json!([{ "type": "function", "function": { "name": "f",
                                                         "parameters": { "type": "nonsense" } } }])),
        Just(json!([{}])),
        scalar()
    ]
}

fn tool_choice() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        Just(json!("required")),
        Just(json!("none")),
        Just(json!({ "type": "any" })),
        Just(json!({ "type": "tool", "name": "g" })),
        Just(json!({ "type": "function", "function": { "name": "f" } })),
        scalar()
    ]
}

fn response_format() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        Just(json!({ "type": "json_object" })),
        Just(json!({ "type": "json_schema", "json_schema": { "schema": {
            "type": "object", "properties": { "a": { "type": "integer" } } } } })),
        Just(json!({ "type": "json_schema", "json_schema": { "schema": { "$ref": "#/nope" } } })),
        Just(json!({ "type": "json_schema", "json_schema": { "schema": { "type": 7 } } })),
        Just(json!({ "type": "json_schema" })),
        scalar()
    ]
}

/// Small or invalid: a valid request generates at most 2 tokens.
fn max_tokens() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!(1)),
        Just(json!(2)),
        Just(json!(0)),
        Just(json!(-1)),
        Just(json!("3")),
        Just(json!(2.5)),
        Just(json!(true))
    ]
}

fn body() -> impl Strategy<Value = Vec<u8>> {
    let json_body = (
        prop_oneof![prop::collection::vec(message(), 0..4).prop_map(Value::from), scalar(),],
        max_tokens(),
        any::<bool>(),
        prop_oneof![Just(Value::Null), Just(json!(1)), Just(json!(2)), scalar()],
        prop_oneof![Just(Value::Null), Just(json!(0)), Just(json!(7)), Just(json!(-1)), scalar()],
        prop_oneof![
            Just(Value::Null),
            Just(json!("x")),
            Just(json!([])),
            Just(json!([""])),
            Just(json!(["a", "b", "c", "d", "e"])),
            scalar()
        ],
        prop_oneof![
            Just(json!("Once")),
            Just(json!([2, 9, 4])),
            Just(json!([999_999_999u32])),
            Just(json!([-1])),
            Just(json!([])),
            scalar()
        ],
        prop_oneof![Just(Value::Null), scalar(), Just(json!("You are terse."))],
        (tools(), tool_choice(), response_format()),
    )
        .prop_map(
            |(messages, max_tokens, stream, n, temperature, stop, prompt, system, more)| {
                let mut body = json!({ "messages": messages, "max_tokens": max_tokens,
                                   "stream": stream, "prompt": prompt });
                let (tools, tool_choice, response_format) = more;
                for (key, value) in [
                    ("n", n),
                    ("temperature", temperature),
                    ("stop", stop),
                    ("system", system),
                    ("tools", tools),
                    ("tool_choice", tool_choice),
                    ("response_format", response_format),
                ] {
                    if !value.is_null() {
                        body[key] = value;
                    }
                }
                serde_json::to_vec(&body).unwrap()
            },
        );
    prop_oneof![
        1 => prop::collection::vec(any::<u8>(), 0..64),
        1 => Just(vec![b'{'; 20_000]),
        8 => json_body,
    ]
}

fn route() -> impl Strategy<Value = &'static str> {
    prop_oneof![Just("/chat/completions"), Just("/completions"), Just("/messages")]
}

async fn send(route: &str, body: Vec<u8>) -> (u16, String) {
    let response = reqwest::Client::new()
        .post(format!("{}{route}", live().base))
        .bearer_auth(KEY)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .expect("the server answers");
    let status = response.status().as_u16();
    (status, response.text().await.expect("the whole body arrives"))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn any_body_gets_an_answer_in_the_api_shape(route in route(), body in body()) {
        let (status, text) = live().runtime.block_on(send(route, body));
        prop_assert!(matches!(status, 200 | 400 | 413 | 503), "{status} {route}: {text}");
        if status != 200 {
            let error: Value = serde_json::from_str(&text).unwrap();
            let message = if route == "/messages" {
                prop_assert_eq!(&error["type"], "error");
                &error["error"]["message"]
            } else {
                &error["error"]["message"]
            };
            prop_assert!(message.as_str().is_some_and(|m| !m.is_empty()), "{}", text);
        } else if text.starts_with("data:") || text.starts_with("event:") {
            // A stream that failed midway ends with an error object; none should here.
            prop_assert!(!text.contains("\"error\""), "{}", text);
        }
    }
}

#[test]
fn the_server_answers_normally_while_it_is_fuzzed() {
    let body = json!({ "messages": [{ "role": "user", "content": "Still fine?" }],
                       "max_tokens": 2 });
    let (status, text) =
        live().runtime.block_on(send("/chat/completions", serde_json::to_vec(&body).unwrap()));
    assert_eq!(status, 200, "{text}");
}
