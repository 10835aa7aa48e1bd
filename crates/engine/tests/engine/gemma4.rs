//! Gemma 4 parity tests (golden files arrive from tests/golden/gemma4).
