//! Prompt lookup: drafts are the tokens that followed the latest earlier occurrence of the
//! conversation's last n-gram. No model, no state; strong on replies that quote the prompt
//! (code edits, summaries, extraction).

use super::{DraftMethod, Target};
use crate::models::Model;
use crate::{Error, Result};

/// N-gram matching in the conversation so far.
#[derive(Debug, Clone)]
pub struct PromptLookup {
    /// The longest suffix matched (tried first).
    pub max_ngram: usize,
    /// The shortest suffix matched.
    pub min_ngram: usize,
    /// Whether a batch waits for every token a pipelined step sampled ahead, to look it up
    /// (drafting wherever a match exists), rather than only where the conversation's last
    /// n-gram already has a match for that token to continue (the default: a step in which no
    /// draft is expected is built without waiting for it).
    pub wait_for_every_token: bool,
}

impl Default for PromptLookup {
    fn default() -> Self {
        PromptLookup { max_ngram: 3, min_ngram: 1, wait_for_every_token: false }
    }
}

impl PromptLookup {
    /// Drafting wherever a match exists ([`PromptLookup::wait_for_every_token`]).
    pub fn waiting_for_every_token() -> PromptLookup {
        PromptLookup { wait_for_every_token: true, ..PromptLookup::default() }
    }
}

impl PromptLookup {
    /// The tokens after the latest earlier occurrence of `context`'s last n tokens, for the
    /// longest n that has one (at most `max` of them).
    pub fn find(&self, context: &[u32], max: usize) -> Vec<u32> {
        let len = context.len();
        for n in (self.min_ngram.max(1)..=self.max_ngram).rev() {
            if len <= n {
                continue;
            }
            let tail = &context[len - n..];
            // Latest first: the most recent context is the best guess of what comes next.
            for start in (0..len - n).rev() {
                if &context[start..start + n] == tail {
                    let follow = &context[start + n..(start + n + max).min(len)];
                    if !follow.is_empty() {
                        return follow.to_vec();
                    }
                }
            }
        }
        Vec::new()
    }
}

impl DraftMethod for PromptLookup {
    fn name(&self) -> &'static str {
        "lookup"
    }

    fn bind(&mut self, _target: &dyn Model) -> Result<()> {
        if self.min_ngram == 0 || self.min_ngram > self.max_ngram {
            return Err(Error::InvalidRequest(format!(
                "prompt lookup needs 1 <= min_ngram <= max_ngram, got {}..{}",
                self.min_ngram, self.max_ngram
            )));
        }
        Ok(())
    }

    fn start(&mut self, _target: Target<'_>, _context: &[u32]) -> Result<usize> {
        Ok(0)
    }

    fn propose(&mut self, _target: Target<'_>, context: &[u32], max: usize) -> Result<Vec<u32>> {
        Ok(self.find(context, max))
    }

    /// Only where the conversation's last n-gram already has a match: the unread token then
    /// most likely continues it. Text that quotes nothing earlier decodes without waiting.
    fn drafts_after_unread(&self, context: &[u32]) -> bool {
        self.wait_for_every_token || !self.find(context, 1).is_empty()
    }

    fn settle(&mut self, _target: Target<'_>, _accepted: usize) -> Result<()> {
        Ok(())
    }

    fn fork(&self) -> Box<dyn DraftMethod> {
        Box::new(self.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_latest_match_wins() {
        let lookup = PromptLookup::default();
        // "5 6 7" occurs twice; the later one is followed by 9 9.
        let context = [1, 5, 6, 7, 8, 8, 5, 6, 7, 9, 9, 2, 5, 6, 7];
        assert_eq!(lookup.find(&context, 2), vec![9, 9]);
        assert_eq!(lookup.find(&context, 8), vec![9, 9, 2, 5, 6, 7]);
        // Only a 1-gram matches: the token after the latest earlier 4.
        assert_eq!(lookup.find(&[4, 1, 2, 4, 3, 4], 2), vec![3, 4]);
        assert!(lookup.find(&[1, 2, 3], 4).is_empty(), "no earlier occurrence");
        assert!(lookup.find(&[7], 4).is_empty());
    }

    #[test]
    fn it_waits_for_an_unread_token_only_to_continue_a_match() {
        let lookup = PromptLookup::default();
        // 3 came before, followed by 4: the unread token most likely continues "3 4".
        assert!(lookup.drafts_after_unread(&[1, 3, 4, 2, 3]));
        // Nothing earlier to continue.
        assert!(!lookup.drafts_after_unread(&[1, 2, 3, 4]));
        assert!(PromptLookup::waiting_for_every_token().drafts_after_unread(&[1, 2, 3, 4]));
    }
}
