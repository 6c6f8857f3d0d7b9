//! A holder's secret ([`Token`]): what proves a claim, a queue place or a
//! waiter registration belongs to its holder. The database keeps only the
//! token's SHA-256.

use std::fmt;

use tokio::time::Instant;

/// A holder's secret: 16 random bytes, sent with its claims; the database
/// keeps only their SHA-256, and only a caller that knows them may release,
/// renew or fence those claims.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Token([u8; 16]);

impl Token {
    pub(crate) fn new() -> Token {
        let mut bytes = [0; 16];
        if getrandom::fill(&mut bytes).is_err() {
            // No OS randomness (a sandbox without getrandom): fall back to
            // the hasher's per-process random keys, still unguessable from
            // another process.
            use std::hash::{BuildHasher, Hasher};
            for chunk in bytes.chunks_mut(8) {
                let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
                hasher.write_u128(Instant::now().elapsed().as_nanos());
                chunk.copy_from_slice(&hasher.finish().to_le_bytes());
            }
        }
        Token(bytes)
    }

    pub(crate) fn bytes(&self) -> Vec<u8> {
        self.0.to_vec()
    }

    /// The token as hex digits, for `decode('..', 'hex')` in a statement
    /// sent with [`Db::batch`](crate::db::Db::batch).
    pub(crate) fn hex(&self) -> String {
        hex(&self.0)
    }

    #[cfg(test)]
    pub(crate) fn from_bytes(bytes: [u8; 16]) -> Token {
        Token(bytes)
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(..)")
    }
}

/// Lowercase hex digits of `bytes`, for `decode('..', 'hex')` in a batch.
fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut out, b| {
            let _ = write!(out, "{b:02x}");
            out
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_random_and_never_printed() {
        assert_ne!(Token::new(), Token::new());
        assert_eq!(format!("{:?}", Token::new()), "Token(..)");
    }

    #[test]
    fn hex_is_lowercase_and_padded() {
        assert_eq!(hex(&[0x00, 0x0f, 0xab, 0xff]), "000fabff");
        assert_eq!(hex(&[]), "");
    }
}
