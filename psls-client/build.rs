//! Writes `psls.pc` (pkg-config) beside the libraries this build makes
//! (`target/<profile>/psls.pc`), so C programs build with
//! `PKG_CONFIG_PATH=target/release pkg-config --cflags --libs psls`: the shared library, found
//! at run time through the rpath it names (`--static` adds what `libpsls_client.a` needs). Nothing else: a failure to write it is a warning, not a failed build.

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=Cargo.toml");
    let (Some(out), Some(manifest)) = (std::env::var_os("OUT_DIR"), std::env::var_os("CARGO_MANIFEST_DIR")) else {
        return;
    };
    // OUT_DIR is target/<profile>/build/<crate>-<hash>/out.
    let Some(libdir) = PathBuf::from(out).ancestors().nth(3).map(PathBuf::from) else {
        return;
    };
    let include = PathBuf::from(manifest).join("include");
    let version = std::env::var("CARGO_PKG_VERSION").unwrap_or_default();
    let pc = format!(
        "libdir={}\nincludedir={}\n\nName: psls\nDescription: PSLS client: map parallel files, barriers, locks and checkpoints (C ABI)\nVersion: {version}\nCflags: -I${{includedir}}\nLibs: -L${{libdir}} -Wl,-rpath,${{libdir}} -lpsls_client\nLibs.private: -lpthread -ldl -lm\n",
        libdir.display(),
        include.display()
    );
    if let Err(e) = std::fs::write(libdir.join("psls.pc"), pc) {
        println!("cargo:warning=psls.pc not written to {}: {e}", libdir.display());
    }
}
