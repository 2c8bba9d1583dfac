//! The chat page at `/`: one self-contained HTML file (no CDN, no external resources: it works offline),
//! compiled into the binary. It streams replies from `/v1/chat/completions`, shows the reasoning apart in a
//! collapsible block, stops a reply (the aborted fetch closes the connection, which cancels the request), starts
//! a new chat, keeps a system prompt and an API key (in the browser's local storage), and shows tokens/s and the
//! time to first token after each reply. Images (PNG, JPEG) are attached to a message from a file button, the
//! clipboard or a drop, previewed and removable before sending, sent as OpenAI `image_url` parts with `data:` URLs
//! beside the text, and shown as thumbnails in the history; a refused request (say, a model that reads no images)
//! shows the server's message and puts the message back in the input. The layout fits a phone.

use axum::http::header;
use axum::response::{Html, IntoResponse, Response};

const PAGE: &str = include_str!("page.html");

pub(crate) async fn index() -> Response {
    (
        [
            (header::CACHE_CONTROL, "no-cache"),
            // The page loads nothing from anywhere: its script and style are inline, its requests same-origin, its
            // images the user's own attachments, read into `data:` URLs.
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:; \
                 connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
            ),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        Html(PAGE),
    )
        .into_response()
}
