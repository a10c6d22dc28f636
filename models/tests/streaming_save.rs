//! Saving streams: writing a checkpoint needs no buffer of the whole file. Measured as the
//! process's peak resident memory (VmHWM) around a save of 256 MiB of F32 weights, which must
//! grow by far less than the file (the whole-file writer this replaced needed the file twice
//! over: encoded tensors, then the serialized buffer). Its own test binary, so nothing else
//! allocates meanwhile.

fn peak_resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[test]
fn saving_does_not_buffer_the_file() {
    let Some(_) = peak_resident_bytes() else {
        println!("skipped: no /proc/self/status on this system");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let n = 16 << 20; // 16 Mi elements per tensor, 4 tensors: 256 MiB of F32
    let tensors: Vec<(String, castor_ir::Tensor)> = (0..4)
        .map(|k| {
            let v: Vec<f32> = (0..n).map(|i| (i ^ k) as f32).collect();
            (
                format!("layer.{k}.weight"),
                castor_ir::Tensor::from_f32(castor_ir::DType::F32, [n], v),
            )
        })
        .collect();
    let refs: Vec<(&str, &castor_ir::Tensor)> =
        tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let before = peak_resident_bytes().unwrap();
    castor_models::write_safetensors(&path, &refs).unwrap();
    let after = peak_resident_bytes().unwrap();
    let file = std::fs::metadata(&path).unwrap().len();
    let grew = after.saturating_sub(before);
    println!(
        "saved {} MiB; peak resident memory grew by {} MiB",
        file >> 20,
        grew >> 20
    );
    assert!(file > 256 << 20);
    assert!(
        grew < 32 << 20,
        "saving {} MiB raised the peak resident memory by {} MiB",
        file >> 20,
        grew >> 20
    );
}
