//! `load_path`: files and directories, dotfiles, the Kubernetes ConfigMap layout, symlink
//! loops, and errors that name their file.

use super::*;

fn write(path: &Path, text: &str) {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).unwrap();
    }
    fs::write(path, text).unwrap();
}

#[test]
fn load_path_single_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("one.yaml");
    write(&file, "domain: one\n");
    let rs = load_path(&file, &LoadOptions::default()).unwrap();
    assert_eq!(rs.sources, vec![file.clone()]);
    assert_eq!(&*domain(&rs, "one").file, file.display().to_string());
}

#[test]
fn load_path_directory_is_recursive_and_sorted() {
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("b.yaml"), "domain: b\n");
    write(&dir.path().join("a.yaml"), "domain: a\n");
    write(&dir.path().join("sub/c.yaml"), "domain: c\n");
    let rs = load_path(dir.path(), &LoadOptions::default()).unwrap();
    let expected: Vec<_> = ["a.yaml", "b.yaml", "sub/c.yaml"]
        .iter()
        .map(|p| dir.path().join(p))
        .collect();
    assert_eq!(rs.sources, expected);
    assert_eq!(rs.domains.len(), 3);
    assert_eq!(
        &*domain(&rs, "c").file,
        dir.path().join("sub/c.yaml").display().to_string()
    );
}

#[test]
fn load_path_directory_errors_name_their_file() {
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("good.yaml"), "domain: good\n");
    write(
        &dir.path().join("bad.yaml"),
        "domain: bad\ndescriptors:\n  - value: x\n",
    );
    let err = load_path(dir.path(), &LoadOptions::default()).unwrap_err();
    assert_eq!(err.0.len(), 1, "{err}");
    assert_eq!(
        err.0[0].file,
        dir.path().join("bad.yaml").display().to_string()
    );
    assert_eq!(err.0[0].line, Some(3));
}

#[test]
fn load_path_dotfiles_are_skipped_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("a.yaml"), "domain: a\n");
    write(&dir.path().join(".hidden.yaml"), "domain: a\n");
    write(&dir.path().join(".git/config"), "not: [yaml\n");
    let err = load_path(dir.path(), &LoadOptions::default()).unwrap_err();
    assert!(
        err.0
            .iter()
            .any(|e| e.message.contains("RUNTIME_IGNOREDOTFILES=true")),
        "{err}"
    );
    assert!(
        err.0
            .iter()
            .any(|e| e.message.contains("YAML syntax error")),
        "{err}"
    );
    let rs = load_path(
        dir.path(),
        &LoadOptions {
            ignore_dotfiles: true,
            merge_domains: false,
            calendar_months: false,
            global_store: false,
        },
    )
    .unwrap();
    assert_eq!(rs.sources, vec![dir.path().join("a.yaml")]);
}

/// The layout kubelet gives a mounted ConfigMap: the files live in a timestamped dot directory,
/// `..data` links to it, and each visible file links through `..data`.
#[cfg(unix)]
#[test]
fn load_path_kubernetes_configmap_layout() {
    use std::os::unix::fs::symlink;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    write(
        &root.join("..2024_01_01_00_00_00.123/ratelimit.yaml"),
        "domain: rl\n",
    );
    write(
        &root.join("..2024_01_01_00_00_00.123/other.yaml"),
        "domain: other\n",
    );
    symlink("..2024_01_01_00_00_00.123", root.join("..data")).unwrap();
    symlink("..data/ratelimit.yaml", root.join("ratelimit.yaml")).unwrap();
    symlink("..data/other.yaml", root.join("other.yaml")).unwrap();

    // Without ignoring dotfiles every file is seen three times: duplicate domains, with a hint.
    let err = load_path(root, &LoadOptions::default()).unwrap_err();
    assert_eq!(err.0.len(), 4, "{err}");
    for e in &err.0 {
        assert!(e.message.starts_with("duplicate domain"), "{e}");
        assert!(e.message.contains("RUNTIME_IGNOREDOTFILES=true"), "{e}");
    }

    let rs = load_path(
        root,
        &LoadOptions {
            ignore_dotfiles: true,
            merge_domains: false,
            calendar_months: false,
            global_store: false,
        },
    )
    .unwrap();
    assert_eq!(
        rs.sources,
        vec![root.join("other.yaml"), root.join("ratelimit.yaml")]
    );
    assert_eq!(rs.domains.len(), 2);
}

#[cfg(unix)]
#[test]
fn load_path_symlink_loop_is_an_error() {
    use std::os::unix::fs::symlink;
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("sub/a.yaml"), "domain: a\n");
    symlink("..", dir.path().join("sub/up")).unwrap();
    let err = load_path(dir.path(), &LoadOptions::default()).unwrap_err();
    assert!(
        err.0.iter().any(|e| e.message.contains("symlink loop")),
        "{err}"
    );
}

#[test]
fn load_path_missing_path_or_empty_directory() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope");
    let err = load_path(&missing, &LoadOptions::default()).unwrap_err();
    assert_eq!(err.0.len(), 1);
    assert_eq!(err.0[0].file, missing.display().to_string());
    assert!(
        err.0[0].message.starts_with("cannot read config path"),
        "{err}"
    );

    let err = load_path(dir.path(), &LoadOptions::default()).unwrap_err();
    assert_eq!(err.0.len(), 1);
    assert_eq!(err.0[0].file, dir.path().display().to_string());
    assert!(err.0[0].message.contains("no config files found"), "{err}");

    // Only dotfiles, skipped: still empty, and the message says why.
    write(&dir.path().join(".only.yaml"), "domain: a\n");
    let err = load_path(
        dir.path(),
        &LoadOptions {
            ignore_dotfiles: true,
            merge_domains: false,
            calendar_months: false,
            global_store: false,
        },
    )
    .unwrap_err();
    assert!(err.0[0].message.contains("RUNTIME_IGNOREDOTFILES"), "{err}");
}

#[test]
fn load_path_empty_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("empty.yaml");
    write(&file, "");
    let err = load_path(&file, &LoadOptions::default()).unwrap_err();
    assert_eq!(err.0.len(), 1);
    assert_eq!(err.0[0].message, "empty config file");
}

#[test]
fn loaded_at_is_now() {
    let before = std::time::SystemTime::now();
    let rs = load("domain: d\n").unwrap();
    assert!(rs.loaded_at >= before);
}
