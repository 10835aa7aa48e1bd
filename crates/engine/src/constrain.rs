//! Constrained decoding: a reply that must match a JSON schema or a grammar. Before each token
//! the sampler masks the logits to the tokens the grammar allows next, and feeds it the token
//! it picked.
//!
//! The grammar engine is [llguidance](https://github.com/guidance-ai/llguidance) (a backend of
//! vLLM's, SGLang's and llama.cpp's structured output): it compiles JSON schemas and Lark
//! grammars itself, computes a token mask from a trie of the vocabulary's bytes in tens of
//! microseconds, and is maintained. Its token trie is built once per tokenizer from
//! `tokenizer.json` (through llguidance's own reader, not `toktrie_hf_tokenizers`, which would
//! pull a second version of the `tokenizers` crate).

use std::fmt;
use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

use crate::{Error, Result};

/// What a reply must be.
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// A JSON value valid under this JSON schema (`{"type": "object"}`: any object).
    JsonSchema(Value),
    /// Text of this Lark grammar (llguidance's dialect: `%json {…}` embeds a schema).
    Lark(String),
    /// One call to one of the turn's tools (to `name` when given), in the model's own syntax,
    /// its arguments valid under the tool's schema ([`crate::tools::ToolSyntax::call_grammar`]).
    ToolCall {
        /// The tool it must call; `None`: any.
        name: Option<String>,
    },
}

/// `schema` with no optional whitespace in its JSON (a reply cannot spend its tokens on blank
/// lines), unless its own `x-guidance` options say otherwise.
pub fn compact(mut schema: Value) -> Value {
    if let Some(fields) = schema.as_object_mut() {
        fields.entry("x-guidance").or_insert(serde_json::json!({ "whitespace_flexible": false }));
    }
    schema
}

/// A tokenizer's vocabulary as the grammar engine reads it; built once, shared by every
/// constrained reply.
#[derive(Clone)]
pub struct Vocabulary {
    factory: Arc<ParserFactory>,
}

impl fmt::Debug for Vocabulary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Vocabulary").finish_non_exhaustive()
    }
}

/// The trie of the vocabulary's bytes, and the real tokenizer for text the grammar fixes (so a
/// forced piece is the token the model would read, not a spelling of it).
struct TokenizerEnv {
    trie: TokTrie,
    tokenizer: tokenizers::Tokenizer,
}

impl TokenizerEnv {
    fn encode(&self, text: &str) -> Vec<TokenId> {
        self.tokenizer.encode(text, false).map(|e| e.get_ids().to_vec()).unwrap_or_default()
    }
}

impl llguidance::toktrie::TokenizerEnv for TokenizerEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |s| self.encode(s))
    }

    fn tokenize_bytes_special(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |s| {
            self.trie.tokenize_with_special(s, |s| self.encode(s))
        })
    }
}

impl Vocabulary {
    /// The vocabulary of `tokenizer_json` (the parsed `tokenizer.json`) and `tokenizer` (the
    /// same, loaded); `stops` end a reply, the first the one a finished grammar emits.
    pub fn new(
        tokenizer_json: &Value,
        tokenizer: tokenizers::Tokenizer,
        stops: &[u32],
    ) -> Result<Vocabulary> {
        let failed = |e: anyhow::Error| Error::Config {
            file: "tokenizer.json".into(),
            message: format!("building the grammar vocabulary: {e:#}"),
        };
        let mut words =
            llguidance::token_bytes_from_tokenizer_json(tokenizer_json).map_err(failed)?;
        // Added tokens: every `<…>` one is a control token, never text the grammar may spell
        // (Gemma marks its `<unusedN>` and `<mask>` not special); the others are text, with
        // SentencePiece's `▁` as the space it decodes to.
        let added = tokenizer_json["added_tokens"].as_array().map_or(&[][..], Vec::as_slice);
        for token in added {
            let (Some(id), Some(content)) = (token["id"].as_u64(), token["content"].as_str())
            else {
                continue;
            };
            let Some(word) = words.get_mut(id as usize) else { continue };
            if word.first() == Some(&TokTrie::SPECIAL_TOKEN_MARKER) {
                continue;
            }
            if content.starts_with('<') && content.ends_with('>') {
                word.insert(0, TokTrie::SPECIAL_TOKEN_MARKER);
            } else {
                *word = content.replace('\u{2581}', " ").into_bytes();
            }
        }
        let end = stops.first().copied().unwrap_or_default();
        let info = TokRxInfo::new(words.len() as u32, end);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(stops);
        let env: TokEnv = Arc::new(TokenizerEnv { trie, tokenizer });
        let mut factory = ParserFactory::new_simple(&env).map_err(failed)?;
        factory.quiet();
        Ok(Vocabulary { factory: Arc::new(factory) })
    }

    /// A fresh grammar state for `constraint`; `stops` are the ids that end the reply (any of
    /// them is allowed once the grammar may end).
    pub fn grammar(&self, constraint: &Constraint, stops: &[u32]) -> Result<Grammar> {
        let grammar = match constraint {
            Constraint::JsonSchema(schema) => TopLevelGrammar::from_json_schema(schema.clone()),
            Constraint::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
            Constraint::ToolCall { .. } => {
                return Err(Error::InvalidRequest(
                    "a tool call's grammar comes from the turn's tools".into(),
                ));
            }
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| Error::InvalidRequest(format!("the output format: {e:#}")))?;
        Ok(Grammar { matcher: Box::new(Matcher::new(Ok(parser))), stops: stops.to_vec() })
    }
}

/// Where a constrained reply stands: the tokens the grammar allows next.
pub struct Grammar {
    matcher: Box<Matcher>,
    stops: Vec<u32>,
}

impl Clone for Grammar {
    fn clone(&self) -> Grammar {
        Grammar { matcher: Box::new(self.matcher.deep_clone()), stops: self.stops.clone() }
    }
}

impl fmt::Debug for Grammar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Grammar").field("stops", &self.stops).finish_non_exhaustive()
    }
}

impl Grammar {
    fn failed(e: anyhow::Error) -> Error {
        Error::InvalidRequest(format!("the reply left its output format: {e:#}"))
    }

    /// An additive mask over `vocab` logits: 0 where the token may come next, −∞ elsewhere
    /// (ids past the tokenizer's never). The reply's stop tokens are allowed once the grammar
    /// may end.
    pub fn mask(&mut self, vocab: usize) -> Result<Vec<f32>> {
        let allowed = self.matcher.compute_mask_or_eos().map_err(Grammar::failed)?;
        let mut mask = vec![f32::NEG_INFINITY; vocab];
        allowed.iter_set_entries(|t| {
            if let Some(m) = mask.get_mut(t) {
                *m = 0.0;
            }
        });
        if self.matcher.is_stopped() || self.matcher.is_accepting().map_err(Grammar::failed)? {
            for &s in &self.stops {
                if let Some(m) = mask.get_mut(s as usize) {
                    *m = 0.0;
                }
            }
        }
        Ok(mask)
    }

    /// Feeds the grammar the token picked (a stop token ends the reply and is not fed).
    pub fn accept(&mut self, token: u32) -> Result<()> {
        if self.stops.contains(&token) {
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(Grammar::failed)
    }
}
