//! Parsing `--mesh data=2,tensor=2` into an all-Explicit mesh.

use std::sync::Arc;

use ferrotext_sharding::Mesh;

use crate::common::UsageError;

/// Parses `name=size[,name=size...]` in mesh order.
pub fn parse_mesh(text: &str) -> Result<Arc<Mesh>, UsageError> {
    let mut axes = Vec::new();
    for part in text.split(',').filter(|p| !p.trim().is_empty()) {
        let (name, size) = part
            .split_once('=')
            .ok_or_else(|| UsageError(format!("mesh axis `{part}` is not `name=size`")))?;
        let size: usize = size.trim().parse().map_err(|_| {
            UsageError(format!("mesh axis `{part}`: size `{size}` is not a number"))
        })?;
        axes.push((name.trim().to_string(), size));
    }
    Mesh::explicit(axes)
        .map(Arc::new)
        .map_err(|e| UsageError(format!("--mesh {text}: {e}")))
}
