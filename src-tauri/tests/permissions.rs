//! Every command the UI invokes is granted to its window: a command missing from `build.rs`'s
//! list or from `capabilities/default.json` is refused at run time ("not allowed"), which no
//! other test sees until a user presses the button (Stop on a reply still waiting for its
//! model did nothing that way).

use std::collections::BTreeSet;

/// The command names `ui/src/ipc/commands.ts` passes to `invoke("…"`.
fn invoked() -> BTreeSet<String> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../ui/src/ipc/commands.ts");
    let source = std::fs::read_to_string(path).expect("the UI's command wrappers");
    source
        .split("invoke")
        .skip(1)
        .filter_map(|rest| {
            let rest = rest.trim_start_matches(|c| c != '(' && c != '"');
            let name = rest.strip_prefix("(\"")?;
            Some(name[..name.find('"')?].to_string())
        })
        .collect()
}

#[test]
fn every_command_the_ui_invokes_is_granted() {
    let commands = invoked();
    assert!(commands.len() > 20 && commands.contains("send_message"), "parsed {commands:?}");
    let capability: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/capabilities/default.json"))
            .unwrap(),
    )
    .unwrap();
    let granted: BTreeSet<&str> =
        capability["permissions"].as_array().unwrap().iter().filter_map(|p| p.as_str()).collect();
    let missing: Vec<&String> = commands
        .iter()
        .filter(|c| !granted.contains(format!("allow-{}", c.replace('_', "-")).as_str()))
        .collect();
    assert!(missing.is_empty(), "invoked by the UI but not granted: {missing:?}");
}
