//! The batched forward: a sequence's logits are bit-identical whether it is read alone in one call, in pieces,
//! or stacked with other sequences in one call (f32 weights and the 4-bit path, where one row goes through the
//! GEMV kernel and several through the GEMM kernel).

use tern_model::forward::Part;
use tern_model::mlx::{HfValues, QuantSpec};
use tern_model::safetensors::Checkpoint;
use tern_model::testutil::fixtures_dir;
use tern_model::weights::Linear;
use tern_model::{Logits, State, Weights};

fn ids(vocab: usize, n: usize, salt: u64) -> Vec<u32> {
    (0..n as u64).map(|i| ((i * 2654435761 + salt * 40503 + 17) % vocab as u64) as u32).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// tiny-b as stored (f32), tiny-b with every linear in 4 bits (group 32), tiny-a with the real recipe.
fn models() -> Vec<(&'static str, Weights)> {
    let dir = fixtures_dir().join("tiny-b");
    let f32w = Weights::load(&dir).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let spec = QuantSpec::recipe(&f32w.config, 4, 32);
    let mut q = Weights::from_values(f32w.config.clone(), &HfValues::new(&ckpt).unwrap(), Some(&spec)).unwrap();
    assert!(q.linears_mut().iter().all(|l| matches!(l, Linear::Quant(_))));
    let a = Weights::load_with(&fixtures_dir().join("tiny-a"), tern_model::LoadOptions { quantize: true }).unwrap();
    vec![("tiny-b f32", f32w), ("tiny-b 4-bit", q), ("tiny-a 4-bit", a)]
}

#[test]
fn pieces_equal_one_call_bit_for_bit() {
    for (name, w) in models() {
        let v = w.config.vocab_size;
        let ids = ids(v, 70, 1);
        let full = w.forward(&ids, &mut State::new(&w.config), Logits::All);
        for cuts in [vec![1], vec![33], vec![10, 47], (1..70).collect::<Vec<_>>()] {
            let mut st = State::new(&w.config);
            let mut got = vec![];
            let mut at = 0;
            for end in cuts.iter().copied().chain([70]) {
                got.extend(w.forward(&ids[at..end], &mut st, Logits::All));
                at = end;
            }
            assert!(bits(&got) == bits(&full), "{name}: pieces at {cuts:?} differ from one call");
        }
    }
}

#[test]
fn a_sequence_in_a_batch_equals_it_alone_bit_for_bit() {
    for (name, w) in models() {
        let v = w.config.vocab_size;
        // Three sequences: a long prompt, a short one, one that starts later; read in rounds where they are
        // at different stages (chunks of different sizes beside single decode tokens), asking for every kind
        // of logits.
        let seqs: Vec<Vec<u32>> = [(40, 2), (9, 3), (25, 4)].iter().map(|&(n, s)| ids(v, n, s)).collect();
        let rounds: [&[(usize, usize, Logits)]; 4] = [
            &[(0, 17, Logits::Skip), (1, 8, Logits::Last)],
            &[(0, 23, Logits::Last), (1, 1, Logits::All), (2, 20, Logits::All)],
            &[(0, 0, Logits::Last), (2, 5, Logits::Last)],
            &[(1, 0, Logits::All), (0, 0, Logits::All), (2, 0, Logits::Last)],
        ];
        // A length of 0 means "one decode token": the next id of a fixed stream.
        let mut batched: Vec<State> = seqs.iter().map(|_| State::new(&w.config)).collect();
        let mut alone: Vec<State> = seqs.iter().map(|_| State::new(&w.config)).collect();
        let mut read = vec![0usize; seqs.len()];
        for (r, round) in rounds.iter().enumerate() {
            let chunks: Vec<Vec<u32>> = round
                .iter()
                .map(|&(s, n, _)| {
                    if n == 0 {
                        vec![(7 * r as u32 + s as u32) % v as u32]
                    } else {
                        seqs[s][read[s]..read[s] + n].to_vec()
                    }
                })
                .collect();
            for &(s, n, _) in round.iter() {
                read[s] += n;
            }
            let want: Vec<Vec<f32>> =
                round.iter().zip(&chunks).map(|(&(s, _, which), ids)| w.forward(ids, &mut alone[s], which)).collect();
            let mut states: Vec<Option<&mut State>> = batched.iter_mut().map(Some).collect();
            let mut parts: Vec<Part> = round
                .iter()
                .zip(&chunks)
                .map(|(&(s, _, which), ids)| Part { ids, state: states[s].take().unwrap(), logits: which })
                .collect();
            let got = w.forward_batch(&mut parts);
            assert_eq!(got.len(), want.len());
            for (i, (g, want)) in got.iter().zip(&want).enumerate() {
                let rows = match round[i].2 {
                    Logits::All => chunks[i].len(),
                    Logits::Last => 1,
                    Logits::Skip => 0,
                };
                assert_eq!(g.len(), rows * v, "{name}: round {r} part {i}: rows");
                assert!(bits(g) == bits(want), "{name}: round {r} part {i}: batched logits differ from alone");
            }
        }
        for (b, a) in batched.iter().zip(&alone) {
            assert_eq!(b.pos, a.pos);
        }
        println!("{name}: 4 rounds of 3 sequences, batched logits bit-identical to each alone");
    }
}
