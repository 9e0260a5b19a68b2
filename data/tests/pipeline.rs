//! The data pipeline on one process: workers never change the order, errors
//! and panics in workers reach the loop naming the sample (never a hang),
//! bad input is refused clearly, and a token file is memory-mapped.

use accel_data::{
    Collate, DataError, DataLoader, Dataset, IterableDataset, JsonLines, Loaded, Pad, Sample,
    Sharding, Stack, TensorDataset, TokenDtype, TokenFile,
};
use std::time::{Duration, Instant};
use tch::{Kind, Tensor};

fn rows(n: i64) -> TensorDataset {
    let x = Tensor::arange(n * 3, (Kind::Float, tch::Device::Cpu)).view([n, 3]);
    let i = Tensor::arange(n, (Kind::Int64, tch::Device::Cpu));
    TensorDataset::new([("x", x), ("i", i)]).unwrap()
}

fn ids(batch: &Sample) -> Vec<i64> {
    Vec::<i64>::try_from(&batch["i"]).unwrap()
}

fn epoch_ids(loader: DataLoader, epochs: u64) -> Vec<Vec<Vec<i64>>> {
    let shard = loader.shard(Sharding::single()).unwrap();
    (0..epochs)
        .map(|e| {
            shard
                .epoch(e, 0)
                .unwrap()
                .map(|b| ids(&b.unwrap().batch))
                .collect()
        })
        .collect()
}

#[test]
fn the_number_of_workers_never_changes_the_batches() {
    let reference = epoch_ids(DataLoader::from_dataset(rows(103), 8).shuffle(7), 3);
    assert_eq!(reference[0].len(), 13);
    assert_ne!(reference[0], reference[1], "a new order every epoch");
    for workers in [1, 4] {
        for persistent in [false, true] {
            let loader = DataLoader::from_dataset(rows(103), 8)
                .shuffle(7)
                .num_workers(workers)
                .prefetch_factor(1)
                .persistent_workers(persistent);
            assert_eq!(
                epoch_ids(loader, 3),
                reference,
                "{workers} workers, persistent {persistent}"
            );
        }
    }
    // Streams too.
    let stream = || {
        IterableDataset::new(|epoch| {
            (0..21i64).map(move |i| Sample::new().with("i", Tensor::from(i + 100 * epoch as i64)))
        })
    };
    let one = epoch_ids(DataLoader::from_iterable(stream(), 4), 2);
    assert_eq!(one[1][0], vec![100, 101, 102, 103]);
    assert_eq!(
        epoch_ids(DataLoader::from_iterable(stream(), 4).num_workers(4), 2),
        one
    );
}

/// Fails at one index and panics at another.
struct Faulty;

impl Dataset for Faulty {
    fn len(&self) -> usize {
        64
    }

    fn get(&self, index: usize) -> Result<Sample, DataError> {
        match index {
            37 => Err(DataError::sample(index, "corrupt record")),
            41 => panic!("tokenizer blew up"),
            _ => Ok(Sample::new().with("i", Tensor::from(index as i64))),
        }
    }
}

fn first_error(loader: DataLoader) -> (usize, String) {
    let shard = loader.shard(Sharding::single()).unwrap();
    let mut good = 0;
    let started = Instant::now();
    let mut epoch = shard.epoch(0, 0).unwrap();
    for item in epoch.by_ref() {
        match item {
            Ok(_) => good += 1,
            Err(e) => {
                assert!(epoch.next().is_none(), "the epoch ends after an error");
                assert!(started.elapsed() < Duration::from_secs(30));
                return (good, e.to_string());
            }
        }
    }
    panic!("no error in a faulty dataset");
}

#[test]
fn errors_and_panics_in_workers_reach_the_loop_naming_the_sample() {
    for workers in [0, 1, 4] {
        let (good, err) = first_error(DataLoader::from_dataset(Faulty, 4).num_workers(workers));
        assert_eq!(good, 9, "{workers} workers: batches before the faulty one");
        assert!(
            err.contains("sample 37") && err.contains("corrupt record"),
            "{err}"
        );
        let skip_37 = DataLoader::from_dataset(Faulty, 4)
            .num_workers(workers)
            .sampler(accel_data::SequentialSampler);
        let shard = skip_37.shard(Sharding::single()).unwrap();
        // From batch 10 on (samples 40..) the panic at 41 comes first.
        let err = shard
            .epoch(0, 10)
            .unwrap()
            .find_map(Result::err)
            .expect("the panic arrives as an error");
        assert!(
            err.to_string().contains("sample 41") && err.to_string().contains("tokenizer blew up"),
            "{err}"
        );
    }
    // A panicking collate names the batch's samples.
    let boom = |_: Vec<Sample>| -> Result<Sample, DataError> { panic!("collate bug") };
    let (_, err) = first_error(
        DataLoader::from_dataset(rows(8), 4)
            .collate(boom)
            .num_workers(2),
    );
    assert!(
        err.contains("sample 0") && err.contains("collate bug"),
        "{err}"
    );
}

#[test]
fn an_abandoned_epoch_of_an_endless_stream_stops_its_workers() {
    let endless =
        IterableDataset::new(|_| (0i64..).map(|i| Sample::new().with("i", Tensor::from(i))));
    let shard = DataLoader::from_iterable(endless, 4)
        .num_workers(2)
        .shard(Sharding::single())
        .unwrap();
    let started = Instant::now();
    for _ in 0..3 {
        let got: Vec<Loaded> = shard
            .epoch(0, 0)
            .unwrap()
            .take(5)
            .map(Result::unwrap)
            .collect();
        assert_eq!(ids(&got[4].batch), vec![16, 17, 18, 19]);
    }
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[test]
fn the_stacking_collate_names_key_index_and_both_shapes() {
    let s = |n: i64| {
        Sample::new().with(
            "input_ids",
            Tensor::zeros([n], (Kind::Int64, tch::Device::Cpu)),
        )
    };
    let err = Stack
        .collate(&[3, 9], vec![s(4), s(5)])
        .unwrap_err()
        .to_string();
    for part in ["sample 9", "input_ids", "[5]", "sample 3", "[4]"] {
        assert!(err.contains(part), "{part} missing from: {err}");
    }
    let err = Stack
        .collate(
            &[0, 1],
            vec![s(4), Sample::new().with("labels", Tensor::from(1))],
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("sample 1"), "{err}");
}

#[test]
fn padding_pads_each_key_with_its_value_and_masks() {
    let s = |v: &[i64]| {
        Sample::new()
            .with("input_ids", Tensor::from_slice(v))
            .with("labels", Tensor::from_slice(v))
            .with("score", Tensor::from(v.len() as f64))
    };
    let b = Pad::new()
        .pad_value("input_ids", 50256.0)
        .pad_value("labels", -100.0)
        .collate(&[0, 1, 2], vec![s(&[1, 2]), s(&[3, 4, 5, 6]), s(&[7])])
        .unwrap();
    let rows = |k: &str| Vec::<Vec<i64>>::try_from(&b[k]).unwrap();
    assert_eq!(
        rows("input_ids"),
        vec![
            vec![1, 2, 50256, 50256],
            vec![3, 4, 5, 6],
            vec![7, 50256, 50256, 50256]
        ]
    );
    assert_eq!(rows("labels")[2], vec![7, -100, -100, -100]);
    assert_eq!(
        rows("attention_mask"),
        vec![vec![1, 1, 0, 0], vec![1, 1, 1, 1], vec![1, 0, 0, 0]]
    );
    assert_eq!(b["score"].size(), vec![3]);
    let err = Pad::new()
        .pad_to_multiple_of(0)
        .collate(&[0], vec![s(&[1])])
        .unwrap_err();
    assert!(err.to_string().contains("pad_to_multiple_of(0)"), "{err}");
}

fn write_tokens(dir: &std::path::Path, bytes: &[u8]) -> std::path::PathBuf {
    let path = dir.join("tokens.bin");
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn bad_token_files_and_empty_data_are_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let odd = write_tokens(dir.path(), &[0u8; 21]);
    let err = TokenFile::open(&odd, TokenDtype::U16, 4)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("tokens.bin") && err.contains("21 bytes") && err.contains("2-byte"),
        "{err}"
    );
    let short = write_tokens(dir.path(), &[0u8; 16]);
    let err = TokenFile::open(&short, TokenDtype::U32, 4)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("4 tokens") && err.contains("block size 4"),
        "{err}"
    );
    assert!(TokenFile::open(dir.path().join("missing.bin"), TokenDtype::U16, 4).is_err());
    let u32s: Vec<u8> = (0u32..9).flat_map(|t| (t * 70_000).to_le_bytes()).collect();
    let wide = TokenFile::open(write_tokens(dir.path(), &u32s), TokenDtype::U32, 4).unwrap();
    assert_eq!(wide.len(), 2);
    assert_eq!(
        Vec::<i64>::try_from(&wide.get(1).unwrap()["labels"]).unwrap(),
        vec![350_000, 420_000, 490_000, 560_000]
    );

    let empty = TensorDataset::pair(
        Tensor::zeros([0, 2], (Kind::Float, tch::Device::Cpu)),
        Tensor::zeros([0], (Kind::Float, tch::Device::Cpu)),
    )
    .unwrap();
    let err = DataLoader::from_dataset(empty, 4)
        .shard(Sharding::single())
        .unwrap_err()
        .to_string();
    assert!(err.contains("empty"), "{err}");
    let err = DataLoader::from_dataset(rows(4), 0)
        .shard(Sharding::single())
        .unwrap_err()
        .to_string();
    assert!(err.contains("batch size 0"), "{err}");
    let err = TensorDataset::pair(
        Tensor::zeros([3, 2], (Kind::Float, tch::Device::Cpu)),
        Tensor::zeros([4], (Kind::Float, tch::Device::Cpu)),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("4 rows") && err.contains("has 3"), "{err}");

    let jsonl = dir.path().join("bad.jsonl");
    std::fs::write(&jsonl, "{\"t\": 1}\n{oops\n").unwrap();
    let ds = JsonLines::open(&jsonl, |_| Ok(Sample::new())).unwrap();
    let err = ds.get(1).unwrap_err().to_string();
    assert!(err.contains("bad.jsonl") && err.contains("line 2"), "{err}");
}

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb * 1024
}

#[test]
fn a_200_mb_token_file_is_mapped_not_read() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("train.bin");
    {
        use std::io::Write;
        let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
        let chunk: Vec<u8> = (0u16..50_000).flat_map(|t| t.to_le_bytes()).collect();
        for _ in 0..2_000 {
            f.write_all(&chunk).unwrap();
        }
    }
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 200_000_000);
    let before = rss_bytes();
    let ds = TokenFile::open(&path, TokenDtype::U16, 1024).unwrap();
    assert_eq!(ds.len(), (100_000_000 - 1) / 1024);
    let shard = DataLoader::from_dataset(ds, 8)
        .shuffle(1)
        .shard(Sharding::single())
        .unwrap();
    let read: usize = shard
        .epoch(0, 0)
        .unwrap()
        .take(20)
        .map(|b| b.unwrap().batch.batch_size())
        .sum();
    assert_eq!(read, 160);
    let grown = rss_bytes().saturating_sub(before);
    assert!(
        grown < 40_000_000,
        "RSS grew by {grown} bytes reading 160 windows of a 200 MB file"
    );
}

/// A batch's tensors: name, kind, shape and bytes.
type Contents = Vec<(String, String, Vec<i64>, Vec<u8>)>;

/// Every batch of the first two epochs of `loader()` on `ranks` ranks, rank
/// by rank, in order.
fn epoch_bytes(loader: impl Fn() -> DataLoader, ranks: usize) -> Vec<Contents> {
    let mut out = Vec::new();
    for rank in 0..ranks {
        let sharding = Sharding {
            num_processes: ranks,
            process_index: rank,
            ..Sharding::single()
        };
        let shard = loader().shard(sharding).unwrap();
        for epoch in 0..2 {
            for b in shard.epoch(epoch, 0).unwrap() {
                let batch = b.unwrap().batch;
                out.push(
                    batch
                        .iter()
                        .map(|(k, t)| {
                            let n = t.numel() * t.kind().elt_size_in_bytes();
                            let mut bytes = vec![0u8; n];
                            t.contiguous().copy_data_u8(&mut bytes, t.numel());
                            (k.to_owned(), format!("{:?}", t.kind()), t.size(), bytes)
                        })
                        .collect(),
                );
            }
        }
    }
    out
}

/// `rows(n)` through `get` alone: the loader fetches and stacks sample by
/// sample.
struct OneByOne(TensorDataset);

impl Dataset for OneByOne {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn get(&self, index: usize) -> Result<Sample, DataError> {
        self.0.get(index)
    }
}

#[test]
fn in_memory_batches_stacked_in_one_go_equal_those_stacked_sample_by_sample() {
    // Floats, a 1-D column of labels, and a source that is not contiguous
    // (a transposed view), shuffled, sharded over 1 and 3 ranks, with and
    // without the last incomplete batch, with and without workers.
    let tensors = || {
        let x = Tensor::randn([23, 5], (Kind::Float, tch::Device::Cpu));
        let t = Tensor::arange(4 * 23, (Kind::Int64, tch::Device::Cpu))
            .view([4, 23])
            .tr();
        let y = Tensor::arange(23, (Kind::Int64, tch::Device::Cpu)).remainder(3);
        [("x", x), ("t", t), ("y", y)]
    };
    tch::manual_seed(0);
    let fast = TensorDataset::new(tensors()).unwrap();
    tch::manual_seed(0);
    let slow = OneByOne(TensorDataset::new(tensors()).unwrap());
    let (fast, slow) = (std::sync::Arc::new(fast), std::sync::Arc::new(slow));
    for ranks in [1, 3] {
        for drop_last in [false, true] {
            for workers in [0, 2] {
                let batches = |d: &dyn Fn() -> DataLoader| {
                    epoch_bytes(
                        || d().shuffle(5).drop_last(drop_last).num_workers(workers),
                        ranks,
                    )
                };
                let a = batches(&|| DataLoader::from_dataset(fast.clone(), 4));
                let b = batches(&|| DataLoader::from_dataset(slow.clone(), 4));
                assert!(!a.is_empty());
                assert_eq!(
                    a, b,
                    "{ranks} ranks, drop_last {drop_last}, {workers} workers"
                );
            }
        }
    }
}

/// A dataset whose one-go stacking is marked, to see when the loader asks.
struct Marked;

impl Dataset for Marked {
    fn len(&self) -> usize {
        6
    }

    fn get(&self, index: usize) -> Result<Sample, DataError> {
        Ok(Sample::new().with("i", Tensor::from(index as i64)))
    }

    fn get_stacked(&self, indices: &[usize]) -> Option<Result<Sample, DataError>> {
        let marked: Vec<i64> = indices.iter().map(|&i| 1000 + i as i64).collect();
        Some(Ok(Sample::new().with("i", Tensor::from_slice(&marked))))
    }
}

#[test]
fn a_dataset_stacks_its_own_batches_only_under_the_stacking_collate() {
    let first = |loader: DataLoader| epoch_ids(loader, 1)[0][0].clone();
    assert_eq!(
        first(DataLoader::from_dataset(Marked, 3)),
        vec![1000, 1001, 1002]
    );
    // Any other collate gets the samples themselves.
    assert_eq!(
        first(DataLoader::from_dataset(Marked, 3).collate(Pad::new())),
        vec![0, 1, 2]
    );
    let own = |samples: Vec<Sample>| Stack.collate(&[0, 1, 2], samples);
    assert_eq!(
        first(DataLoader::from_dataset(Marked, 3).collate(own)),
        vec![0, 1, 2]
    );
    // A bad index is named as `get` names it.
    let err = TensorDataset::pair(
        Tensor::zeros([2, 1], tch::kind::FLOAT_CPU),
        Tensor::zeros([2], tch::kind::FLOAT_CPU),
    )
    .unwrap()
    .get_stacked(&[1, 5])
    .unwrap()
    .unwrap_err();
    assert!(
        err.to_string().contains('5') && err.to_string().contains("holds 2 samples"),
        "{err}"
    );
}
