! A Fortran program with a known call tree, -O2 -fomit-frame-pointer (tests/test_cfi_unwind.py):
! MAIN__ -> level_a -> level_b -> leaf_spin (built with -fno-inline:
! GCC 12's gfortran has no noinline attribute). `nofp_fortran SECONDS` prints {"pid", "tids", "cpu_s"}.
module tree
  implicit none
  integer(8), volatile :: sink
contains
  subroutine leaf_spin(n, r)
    integer(8), intent(in) :: n
    integer(8), intent(out) :: r
    integer :: i
    integer(8) :: x
    x = n
    do i = 1, 20000
      x = ieor(x * 1103515245_8 + 12345_8, ishft(x, -7))
    end do
    sink = x
    r = x
  end subroutine
  subroutine level_b(n, r)
    integer(8), intent(in) :: n
    integer(8), intent(out) :: r
    integer(8) :: buf(6), t
    integer :: i
    do i = 1, 6
      buf(i) = n + i
    end do
    call leaf_spin(buf(mod(n, 6_8) + 1), t)
    r = t * 3 + buf(2)
  end subroutine
  subroutine level_a(n, r)
    integer(8), intent(in) :: n
    integer(8), intent(out) :: r
    integer(8) :: t
    call level_b(n + 2, t)
    r = t * 7 + n
  end subroutine
end module

program main
  use tree
  implicit none
  integer(8) :: acc, t
  integer(8) :: c0, c1, rate
  real :: seconds, cpu
  character(len=32) :: arg
  interface
    function getpid() bind(c, name="getpid")
      use iso_c_binding, only: c_int
      integer(c_int) :: getpid
    end function
    function usleep(us) bind(c, name="usleep")
      use iso_c_binding, only: c_int
      integer(c_int), value :: us
      integer(c_int) :: usleep
    end function
  end interface
  integer :: rc
  call get_command_argument(1, arg)
  read (arg, *) seconds
  rc = usleep(300000)
  call system_clock(c0, rate)
  acc = 0
  do
    call level_a(acc, t)
    acc = acc + t
    call system_clock(c1)
    if (real(c1 - c0) / real(rate) > seconds) exit
  end do
  sink = acc
  call cpu_time(cpu)
  write (*, '(a,i0,a,i0,a,f8.3,a)') '{"pid": ', getpid(), ', "tids": [', getpid(), '], "cpu_s": ', cpu, '}'
end program
