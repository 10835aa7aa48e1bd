//! Message content both APIs share: text, and images sent inline (base64), imported through
//! the app's attachment folder so the engine reads them as it reads the app's.

use std::path::PathBuf;

use base64::Engine as _;
use chat::Chat;
use engine::turn::TurnMessage;

use crate::error::ApiError;

/// The image in `bytes` (image number `n` of the request), checked to decode and stored.
async fn import_image(chat: &Chat, bytes: &[u8], n: usize) -> Result<PathBuf, ApiError> {
    let name = format!("image {n}");
    let imported =
        chat.import_attachment(bytes, &name).await.map_err(|e| ApiError::from_chat(&e))?;
    Ok(chat.attachments_dir().join(imported.file))
}

/// Appends a text part to `turn`, a line apart from the text it holds.
pub(crate) fn push_text(turn: &mut TurnMessage, text: &str) {
    if !turn.text.is_empty() {
        turn.text.push('\n');
    }
    turn.text.push_str(text);
}

/// Adds image `n` of the request (its bytes) to `turn`, which must be a user message.
pub(crate) async fn push_image(
    chat: &Chat,
    turn: &mut TurnMessage,
    n: usize,
    bytes: Result<Vec<u8>, ApiError>,
) -> Result<(), ApiError> {
    if turn.role != "user" {
        return Err(ApiError::invalid("images are taken in user messages only"));
    }
    turn.images.push(import_image(chat, &bytes?, n).await?);
    Ok(())
}

/// Decodes base64 image data (whitespace allowed, as some clients wrap lines).
pub(crate) fn decode_base64(data: &str, n: usize) -> Result<Vec<u8>, ApiError> {
    let compact: String = data.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    base64::engine::general_purpose::STANDARD
        .decode(compact.as_bytes())
        .map_err(|e| ApiError::invalid(format!("image {n} is not valid base64: {e}")))
}

/// The bytes of an OpenAI `image_url`: a `data:` URL. Remote URLs are refused (the server
/// makes no connection of its own).
pub(crate) fn data_url_bytes(url: &str, n: usize) -> Result<Vec<u8>, ApiError> {
    let Some(rest) = url.strip_prefix("data:") else {
        return Err(ApiError::invalid(format!(
            "image {n}: only data URLs are accepted (data:image/png;base64,…); the server \
             fetches nothing from the network"
        )));
    };
    let Some((meta, data)) = rest.split_once(',') else {
        return Err(ApiError::invalid(format!("image {n}: the data URL has no comma")));
    };
    if !meta.ends_with(";base64") {
        return Err(ApiError::invalid(format!("image {n}: the data URL is not base64")));
    }
    decode_base64(data, n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_urls_decode_and_remote_urls_are_refused() {
        assert_eq!(data_url_bytes("data:image/png;base64,aGk=", 1).unwrap(), b"hi");
        assert_eq!(data_url_bytes("data:image/png;base64,aG\nk=", 1).unwrap(), b"hi");
        for bad in ["https://example.com/a.png", "data:image/png,hi", "data:image/png;base64"] {
            let error = data_url_bytes(bad, 2).unwrap_err();
            assert_eq!(error.status, 400, "{bad}");
            assert!(error.message.contains("image 2"), "{}", error.message);
        }
        assert!(data_url_bytes("data:image/png;base64,!!!", 1).is_err());
    }
}
