//! A client process for the interrupted-import tests: `import-probe SOCKET NAME SIZE [replace]`
//! streams SIZE bytes read from its standard input into an import of NAME (the client
//! library's streamed protocol: `ImportBegin`, data frames, `ImportCommit`) through the daemon
//! listening on SOCKET. Exit status 0 and `imported NAME` once the daemon committed; 1 and
//! the error otherwise. The tests kill it midway, while it waits for more input.

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 4 {
        eprintln!("usage: import-probe SOCKET NAME SIZE [replace]");
        std::process::exit(2);
    }
    let size: u64 = args[3].parse().expect("SIZE");
    let replace = args.get(4).is_some_and(|a| a == "replace");
    let mut client = psls_client::Client::connect(std::path::Path::new(&args[1])).unwrap_or_else(|e| {
        eprintln!("connect: {e}");
        std::process::exit(1)
    });
    match client.import(&mut std::io::stdin().lock(), size, &args[2], 0o644, replace) {
        Ok(f) => println!("imported {}", f.name),
        Err(e) => {
            eprintln!("import: {e}");
            std::process::exit(1)
        }
    }
}
