//! Images attached to messages: checked to decode, then copied into the app's attachment
//! folder under their SHA-256, so a message keeps its images even when the user's file moves.

use std::path::PathBuf;

use sha2::Digest;

use crate::view::PendingAttachment;
use crate::{Chat, Error, MAX_IMAGE_BYTES, Result};

impl Chat {
    /// Checks that `bytes` are an image the engine can read, and copies them into the
    /// attachment folder as `<sha256>.<ext>`.
    pub async fn import_attachment(&self, bytes: &[u8], name: &str) -> Result<PendingAttachment> {
        if bytes.len() > MAX_IMAGE_BYTES {
            return Err(Error::BadImage(format!(
                "{name} is {} MB; images up to {} MB are accepted",
                bytes.len() >> 20,
                MAX_IMAGE_BYTES >> 20
            )));
        }
        let rgb = engine::vision::image::decode_rgb(bytes).map_err(|e| {
            Error::BadImage(format!("{name} is not an image Quince can read ({e})"))
        })?;
        let (mime, ext) = match image_format(bytes) {
            Some(format) => format,
            None => {
                return Err(Error::BadImage(format!(
                    "{name} is not a PNG, JPEG, WebP, GIF or BMP image"
                )));
            }
        };
        let sha: String = sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect();
        let file = format!("{sha}.{ext}");
        let path = self.attachments_dir().join(&file);
        if !path.is_file() {
            // Write then rename, so a crash never leaves a half file under the final name.
            let partial = self.attachments_dir().join(format!("{file}.partial"));
            std::fs::write(&partial, bytes)
                .and_then(|()| std::fs::rename(&partial, &path))
                .map_err(|e| Error::Invalid(format!("cannot save {name}: {e}")))?;
        }
        Ok(PendingAttachment {
            file,
            mime: mime.into(),
            bytes: bytes.len() as u64,
            width: rgb.width(),
            height: rgb.height(),
            name: name.to_string(),
        })
    }

    pub(crate) fn attachment_path(&self, file: &str) -> Result<PathBuf> {
        let path = self.attachments_dir().join(file);
        if !is_attachment_name(file) || !path.is_file() {
            return Err(Error::BadImage(format!(
                "the attachment {file} is missing; attach the image again"
            )));
        }
        Ok(path)
    }
}

/// The MIME type and file extension of image bytes, from their magic number.
fn image_format(bytes: &[u8]) -> Option<(&'static str, &'static str)> {
    match bytes {
        [0x89, b'P', b'N', b'G', ..] => Some(("image/png", "png")),
        [0xFF, 0xD8, 0xFF, ..] => Some(("image/jpeg", "jpg")),
        [b'R', b'I', b'F', b'F', _, _, _, _, b'W', b'E', b'B', b'P', ..] => {
            Some(("image/webp", "webp"))
        }
        [b'G', b'I', b'F', b'8', ..] => Some(("image/gif", "gif")),
        [b'B', b'M', ..] => Some(("image/bmp", "bmp")),
        _ => None,
    }
}

/// Whether `file` can name an imported attachment: letters, digits and dots, not starting with
/// a dot, so it can never leave the attachment folder.
pub fn is_attachment_name(file: &str) -> bool {
    !file.is_empty()
        && !file.starts_with('.')
        && file.chars().all(|c| c.is_ascii_alphanumeric() || c == '.')
}

/// The MIME type of an attachment file name (from the extension it was imported with).
pub fn attachment_mime(file: &str) -> &'static str {
    match file.rsplit('.').next() {
        Some("jpg") => "image/jpeg",
        Some("webp") => "image/webp",
        Some("gif") => "image/gif",
        Some("bmp") => "image/bmp",
        _ => "image/png",
    }
}
